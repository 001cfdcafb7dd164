"""The KV cache as a file of shared memory (executor_service/kv/shared_cache.py), in process: created whole and
locked, removed at stop; a cache that does not fit is plain memory; the directory is everyone's, so what is in
it is checked before it is opened, swept or mapped; the copy engine copies blocks from a peer's file and digests
them as a gRPC read would, and a dead engine fails one copy and starts again."""

import asyncio
import os
import threading
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from executor_service.kv import shared_cache  # noqa: E402
from executor_service.kv.blocks import BlockBytes, digest  # noqa: E402
from executor_service.kv.copy_engine import CopyEngine, EngineDied  # noqa: E402
from executor_service.kv.shared_cache import Segment, as_rows, sweep  # noqa: E402
from executor_service.kv.tensors import allocate_shared, layer_views  # noqa: E402

CFG = SimpleNamespace(num_layers=3, head_dim=8)       # all a cache's shape takes of a model's config


def run(coro):
    return asyncio.run(coro)


def filled(blocks: torch.Tensor, seed: int) -> torch.Tensor:
    blocks.copy_(torch.randn(blocks.shape, generator=torch.Generator().manual_seed(seed)).to(blocks.dtype))
    return blocks


def test_a_cache_in_shared_memory_is_a_locked_file_of_its_exact_size_removed_at_stop(tmp_path):
    blocks, segment = allocate_shared(CFG, 2, 10, 4, "cpu", torch.bfloat16, str(tmp_path))
    assert segment is not None and segment.path.parent == tmp_path
    assert segment.path.stat().st_size == blocks.numel() * blocks.element_size()
    filled(blocks, 0)
    # What the model writes through a layer's view is what a peer finds in the file, block-major.
    k0 = layer_views(blocks)[1][0]
    k0[3].fill_(1.5)
    peer = Segment.open(str(tmp_path), segment.name, 10, BlockBytes.of(blocks).size)
    rows = as_rows(peer.map, BlockBytes.of(blocks).size)
    assert rows[3].tobytes() == BlockBytes.of(blocks).read([3])
    sweep(str(tmp_path))                          # locked: a live executor's
    assert segment.path.exists()
    shared_cache.remove(segment)
    assert not list(tmp_path.iterdir())


def test_a_cache_that_does_not_fit_the_directory_is_plain_memory(tmp_path):
    blocks, segment = allocate_shared(CFG, 2, 10, 4, "cpu", torch.float32, str(tmp_path / "missing"))
    assert segment is None and blocks.shape == (10, 3, 2, 4, 2, 8)
    blocks, segment = allocate_shared(CFG, 2, 10, 4, "cpu", torch.float32, "")
    assert segment is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_copy_engine_copies_from_a_peers_cache_the_bytes_and_digests_a_grpc_read_gives(tmp_path, dtype):
    src_blocks, src_file = allocate_shared(CFG, 2, 12, 4, "cpu", dtype, str(tmp_path))
    dst_blocks, dst_file = allocate_shared(CFG, 2, 12, 4, "cpu", dtype, str(tmp_path))
    src, dst = BlockBytes.of(filled(src_blocks, 1)), BlockBytes.of(filled(dst_blocks, 2))
    engine = CopyEngine(str(dst_file.path), 12, dst.size, str(tmp_path))
    try:
        others, data = dst.read([1, 2, 3, 4, 5]), src.read([7, 9, 11])
        engine.map(src_file.name, 12)
        # Digested as the source digests, `per` blocks at a time.
        assert run(engine.copy(src_file.name, 12, [7, 9, 11], [6, 10, 8], 2)) == [digest(data[:2 * src.size]),
                                                                                  digest(data[2 * src.size:])]
        assert dst.read([6, 10, 8]) == data and dst.read([1, 2, 3, 4, 5]) == others
        assert run(engine.digest([6, 10, 8], 3)) == [digest(data)]       # its own blocks, read in place
        assert run(engine.digest([6, 10, 8], 2)) == [digest(data[:2 * src.size]), digest(data[2 * src.size:])]
        with pytest.raises(ValueError):
            run(engine.copy(src_file.name, 12, [12], [1], 1))              # past the peer's cache
        with pytest.raises(ValueError):
            engine.map(f"stepwire-kv-{'d' * 32}", 12)             # not there: the caller reads through gRPC
        # An engine that dies (a peer's file shrunk under it: SIGBUS) fails the copy under way, not the executor,
        # and the next request starts it again.
        engine.proc.kill()
        with pytest.raises(EngineDied):
            run(engine.copy(src_file.name, 12, [7], [6], 1))
        assert run(engine.digest([6, 10, 8], 3)) == [digest(data)]
    finally:
        engine.close()
        shared_cache.remove(src_file)
        shared_cache.remove(dst_file)
    assert engine.proc is None and not list(tmp_path.iterdir())


def mapped_in(pid: int, name: str) -> int | None:
    """KiB of `name`'s mapping in `pid`'s page tables (None: not mapped), from /proc/PID/smaps."""
    kib, mine = None, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:                      # a mapping's first line
                mine = line.rstrip().endswith("/" + name)
            elif mine and line.startswith("Rss:"):
                kib = (kib or 0) + int(line.split()[1])
    return kib


def until(what, seconds: float = 10.0):
    deadline = time.monotonic() + seconds
    while not what() and time.monotonic() < deadline:
        time.sleep(0.05)
    return what()


def test_the_engine_maps_in_live_peers_caches_ahead_and_unmaps_those_whose_file_went(tmp_path):
    """A pull's copy takes no page fault on a peer that was already there (a fault per 4 KiB halved its speed);
    a dead executor's file left for the next sweep is not mapped, and a stopped peer's memory is not kept."""
    dst_blocks, dst_file = allocate_shared(CFG, 2, 12, 4, "cpu", torch.float32, str(tmp_path))
    size = BlockBytes.of(dst_blocks).size
    live = shared_cache.create(str(tmp_path), 300 * size)
    dead = shared_cache.create(str(tmp_path), 300 * size)
    dead.close()                                # its lock is free (its mapping held it too): an executor that died
    engine = CopyEngine(str(dst_file.path), 12, size, str(tmp_path))
    try:
        run(engine.digest([1], 1))              # started
        pid = engine.proc.pid
        assert until(lambda: (mapped_in(pid, live.name) or 0) >= 300 * size // 1024)       # every page
        assert mapped_in(pid, dead.name) is None
        later = shared_cache.create(str(tmp_path), 300 * size)             # a peer that starts later
        assert until(lambda: mapped_in(pid, later.name) is not None)
        shared_cache.remove(live)               # a peer that stopped
        assert until(lambda: mapped_in(pid, live.name) is None)
        assert mapped_in(pid, later.name) is not None
        shared_cache.remove(later)
    finally:
        engine.close()
        for f in (dead, dst_file):
            shared_cache.remove(f)


def test_a_cancelled_copy_returns_only_once_the_engine_is_done_and_the_next_request_gets_its_own_answer(tmp_path):
    """Else the blocks could be given to another request while the engine still writes them, and the next
    request would read the cancelled one's answer."""
    src_blocks, src_file = allocate_shared(CFG, 2, 4096, 4, "cpu", torch.float32, str(tmp_path))
    dst_blocks, dst_file = allocate_shared(CFG, 2, 4096, 4, "cpu", torch.float32, str(tmp_path))
    src, dst = BlockBytes.of(filled(src_blocks, 1)), BlockBytes.of(dst_blocks)
    engine = CopyEngine(str(dst_file.path), 4096, dst.size, str(tmp_path))
    ids = list(range(1, 4096))

    async def main():
        copying = asyncio.ensure_future(engine.copy(src_file.name, 4096, ids, ids, 4096))
        await asyncio.sleep(0.01)
        copying.cancel()
        with pytest.raises(asyncio.CancelledError):
            await copying
        assert dst.read(ids) == src.read(ids)          # done before the cancel came back
        return await engine.digest([1, 2], 1)

    try:
        assert run(main()) == [digest(src.read([1])), digest(src.read([2]))]
    finally:
        engine.close()
        shared_cache.remove(src_file)
        shared_cache.remove(dst_file)


def test_a_sweep_removes_files_nobody_holds_and_leaves_live_ones_fifos_and_strangers_alone(tmp_path):
    live = shared_cache.create(str(tmp_path), 1 << 16)
    dead = tmp_path / f"stepwire-kv-{'a' * 32}"
    dead.write_bytes(b"\0" * 4096)
    fifo = tmp_path / f"stepwire-kv-{'b' * 32}"
    os.mkfifo(fifo)
    other = tmp_path / "stepwire-kv-not-ours"
    other.write_bytes(b"x")
    done = threading.Event()
    threading.Thread(target=lambda: (sweep(str(tmp_path)), done.set()), daemon=True).start()
    assert done.wait(10), "the sweep waited on a FIFO"
    assert not dead.exists() and fifo.exists() and other.exists() and live.path.exists()
    shared_cache.remove(live)


@pytest.mark.parametrize("case", ["a FIFO", "shorter than announced", "too many blocks", "an odd name"])
def test_a_reader_maps_only_a_regular_file_of_ours_of_exactly_the_announced_size(tmp_path, case):
    name, block = f"stepwire-kv-{'c' * 32}", 1024
    if case == "a FIFO":
        os.mkfifo(tmp_path / name)
    else:
        with open(tmp_path / name, "wb") as f:
            f.truncate(4 * block)
    if case == "an odd name":
        assert Segment.open(str(tmp_path), name, 4, block).size == 4 * block     # the same file, named right
    blocks = {"shorter than announced": 5, "too many blocks": shared_cache.MAX_BLOCKS + 1}.get(case, 4)
    with pytest.raises(ValueError):
        Segment.open(str(tmp_path), "../" + name if case == "an odd name" else name, blocks, block)


def test_the_copy_engine_imports_neither_torch_nor_grpc():
    """It starts with its executor and must start fast and small; and a GIL of its own is its point."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import sys, executor_service.kv.copy_worker; "
                          "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'grpc'}))"],
                         capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.stdout.strip() == "[]"


def test_the_event_loop_never_waits_on_a_lock_that_a_copy_under_way_holds(tmp_path):
    """The loop's copy holds the engine's lock until the loop reads its answer: a forget that waited on that lock
    from the loop, or on the mappings' lock while a thread held it waiting for the engine, would never end
    (checked from another thread, so that a regression fails instead of hanging)."""
    from executor_service.kv.mapped_block_source import Mappings
    from stepwire.internal import executor_pb2
    src_blocks, src_file = allocate_shared(CFG, 2, 4096, 4, "cpu", torch.float32, str(tmp_path))
    dst_blocks, dst_file = allocate_shared(CFG, 2, 4096, 4, "cpu", torch.float32, str(tmp_path))
    size = BlockBytes.of(dst_blocks).size
    engine = CopyEngine(str(dst_file.path), 4096, size, str(tmp_path))
    mappings = Mappings(engine, str(tmp_path))
    ids, result = list(range(1, 4096)), {}

    async def main():
        mappings.note("10.0.0.1:50061", executor_pb2.CacheFile(name=src_file.name, num_blocks=4096))
        copying = asyncio.ensure_future(engine.copy(src_file.name, 4096, ids, ids, 4096))
        await asyncio.sleep(0.005)                 # the copy's request is with the engine
        # A pull from a source seen for the first time maps its cache on a thread, which waits for the engine.
        mapping = asyncio.ensure_future(asyncio.to_thread(
            mappings.get, "10.0.0.2:50061", executor_pb2.CacheFile(name=src_file.name, num_blocks=4096)))
        await asyncio.sleep(0.005)
        mappings.note("10.0.0.3:50061", executor_pb2.CacheFile(name=src_file.name, num_blocks=4096))  # ahead
        await mappings.drop("10.0.0.1:50061")      # another pull from that source failed
        result["digests"] = await copying
        await mapping

    loop = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    try:
        loop.start()
        loop.join(30)
        assert not loop.is_alive() and len(result["digests"]) == 1
    finally:
        if not loop.is_alive():
            engine.close()
            shared_cache.remove(src_file)
            shared_cache.remove(dst_file)


def test_only_a_regular_file_of_ours_named_as_a_cache_is_copied_from_ahead(tmp_path, monkeypatch):
    """Any other name the scheduler passes on (another user's file, a FIFO, a path) goes the slow way: the
    source's answer names its file, and gRPC serves where that does not map."""
    from executor_service.kv.mapped_block_source import Mappings
    from stepwire.internal import executor_pb2
    ours = shared_cache.create(str(tmp_path), 4096)
    fifo = f"stepwire-kv-{'f' * 32}"
    os.mkfifo(tmp_path / fifo)
    m = Mappings(None, str(tmp_path))
    named = lambda name: m.here("10.0.0.1:50061", executor_pb2.CacheFile(name=name, num_blocks=1))  # noqa: E731
    try:
        assert named(ours.name)
        assert not named(fifo) and not named(f"stepwire-kv-{'0' * 32}") and not named("../" + ours.name)
        uid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: uid + 1)       # the file is another user's
        assert not named(ours.name)
    finally:
        shared_cache.remove(ours)
