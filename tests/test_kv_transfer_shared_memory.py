"""KV blocks between executors on one host are copied straight from the source's cache, a file of shared memory
(executor_service/kv/shared_cache.py), on real executor processes of the tiny model: the same bytes as through
gRPC; gRPC where the file does not map or the source's cache is not in shared memory; hostile readers refused
with a clear status, hostile sources read through gRPC or refused, and no file left."""

import asyncio

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("torch")

from test_executor_server import fresh_epoch  # noqa: E402
from test_kv_transfer_executor import Stream, prefill_and_decode, pull, read, serve_fake  # noqa: E402
from tiny_model import kv_bytes, write_tiny_llama  # noqa: E402

from executor_service.kv import shared_cache  # noqa: E402
from launcher.processes import Service, Stack  # noqa: E402
from stepwire.internal import executor_pb2, executor_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """a and b share a shared-memory directory (one host); c's cache is plain memory (--kv-shared-memory-dir '')."""
    tmp = tmp_path_factory.mktemp("shm")
    model = write_tiny_llama(tmp / "llama")
    shared, elsewhere = tmp / "shared", tmp / "elsewhere"
    shared.mkdir()
    elsewhere.mkdir()
    flags = {"--model": model, "--block-size": 4, "--kv-cache-memory": kv_bytes(64), "--max-num-seqs": 8,
             "--max-model-len": 128, "--metrics-address": "", "--threads": 1}
    with Stack([Service("executor", "a", flags={**flags, "--kv-shared-memory-dir": shared}),
                Service("executor", "b", flags={**flags, "--kv-shared-memory-dir": shared}),
                Service("executor", "c", flags={**flags, "--kv-shared-memory-dir": ""})], tmp) as stack:
        chans = {n: grpc.insecure_channel(stack[n].address) for n in "abc"}
        stubs = {n: executor_pb2_grpc.ExecutorStub(c) for n, c in chans.items()}
        # a's and b's caches are files there, of the whole cache each.
        assert sorted(f.stat().st_size for f in shared.iterdir()) == [kv_bytes(64)] * 2
        # The executors' dtype (float32 in the suite, or whichever is forced) sets how many blocks the budget holds.
        d = stubs["a"].Describe(executor_pb2.DescribeRequest())
        yield {"stack": stack, "stub": stubs, "shared": shared, "elsewhere": elsewhere, "layout": d.kv_layout,
               "num_blocks": d.num_blocks, "block": kv_bytes(64) // d.num_blocks}
        for c in chans.values():
            c.close()
    # Each executor removes its file when it stops: nothing is left.
    assert not list(shared.iterdir())


def filled(trio, name="a") -> Stream:
    """`name`'s Step stream, with PROMPT's KV in its blocks 1..7 (not zeros, so that a wrong copy shows)."""
    s = Stream(trio["stub"][name], fresh_epoch())
    prefill_and_decode(s, list(range(1, 10)), decode=0)
    return s


@pytest.mark.parametrize("source, target, transport", [("a", "b", "shared_memory"), ("a", "c", "grpc"),
                                                       ("c", "b", "grpc")])
def test_a_pull_copies_from_the_sources_cache_where_it_maps_and_goes_through_grpc_where_not(trio, source, target,
                                                                                          transport):
    """c reads through gRPC (it maps nothing), and b reads c's through gRPC (c's cache is not a file: the source
    says UNIMPLEMENTED)."""
    stub, layout = trio["stub"], trio["layout"]
    s = filled(trio, source)
    t = Stream(stub[target], fresh_epoch())
    t.send()
    src, dst = [1, 2, 3, 4, 5, 6, 7], [20, 21, 22, 23, 24, 25, 26]
    reply = pull(stub[target], trio["stack"][source].address, src, dst, layout, t.epoch, s.epoch)
    assert reply.transport == transport and reply.bytes == 7 * trio["block"]
    assert read(stub[target], dst, layout, t.epoch) == read(stub[source], src, layout, s.epoch)
    s.close()
    t.close()


@pytest.mark.parametrize("case, code", [("a bad block id", grpc.StatusCode.INVALID_ARGUMENT),
                                        ("another layout", grpc.StatusCode.FAILED_PRECONDITION),
                                        ("another epoch", grpc.StatusCode.FAILED_PRECONDITION)])
def test_a_mapped_read_is_admitted_as_a_grpc_read_is(trio, case, code):
    stub, layout = trio["stub"], trio["layout"]
    a = filled(trio)
    request = executor_pb2.ReadBlocksRequest(blocks=[0, 2] if case == "a bad block id" else [1, 2],
                                             kv_layout="other" if case == "another layout" else layout,
                                             epoch=a.epoch + (case == "another epoch"))
    with pytest.raises(grpc.RpcError) as e:
        list(stub["a"].ReadBlocksMapped(request, timeout=5))
    assert e.value.code() == code, e.value.details()
    # A reader that takes the file's name and goes costs the source nothing it must get back.
    call = stub["a"].ReadBlocksMapped(executor_pb2.ReadBlocksRequest(blocks=[1, 2], kv_layout=layout,
                                                                     epoch=a.epoch), timeout=5)
    assert next(call).file.num_blocks == trio["num_blocks"]
    call.cancel()
    b = Stream(stub["b"], fresh_epoch())
    b.send()
    assert pull(stub["b"], trio["stack"]["a"].address, [1, 2], [40, 41], layout, b.epoch,
                a.epoch).transport == "shared_memory"
    a.close()
    b.close()


def test_an_executor_names_its_cache_file_in_describe_where_it_is_in_shared_memory(trio):
    stub = trio["stub"]
    names = {n: stub[n].Describe(executor_pb2.DescribeRequest()).kv_cache_file for n in "abc"}
    assert sorted(f.name for f in trio["shared"].iterdir()) == sorted([names["a"], names["b"]])
    assert names["c"] == ""


@pytest.mark.parametrize("named", ["its own cache", "a copy of it under another name", "a file not here",
                                   "a name outside the directory"])
def test_a_pull_told_the_sources_cache_copies_at_once_and_keeps_only_what_the_source_confirms(trio, named):
    """The scheduler names the source's cache where its blocks are final: the target copies before the source
    answers. The source's answer must name that same file: a copy of its bytes under another name (whose digests
    match) is refused. A name that is not a file here is ignored: the pull learns the file from the source."""
    stub, layout, shared = trio["stub"], trio["layout"], trio["shared"]
    a = filled(trio)
    b = Stream(stub["b"], fresh_epoch())
    b.send()
    own = stub["a"].Describe(executor_pb2.DescribeRequest()).kv_cache_file
    other = None
    name = {"its own cache": own, "a file not here": f"stepwire-kv-{'e' * 32}",
            "a name outside the directory": "../../../etc/passwd"}.get(named)
    if named == "a copy of it under another name":
        other = shared_cache.Segment.create(str(shared), trio["num_blocks"] * trio["block"])
        other.map[:] = (shared / own).read_bytes()
        name = other.name
    request = executor_pb2.PullBlocksRequest(
        transfer_id="t", source=trio["stack"]["a"].address, source_blocks=[1, 2, 3], target_blocks=[60, 61, 62],
        kv_layout=layout, epoch=b.epoch, after_step=-1, source_epoch=a.epoch, deadline_seconds=10,
        source_cache=executor_pb2.CacheFile(name=name, num_blocks=trio["num_blocks"]))
    try:
        if other is not None:
            with pytest.raises(grpc.RpcError) as e:
                stub["b"].PullBlocks(request, timeout=15)
            assert e.value.code() == grpc.StatusCode.DATA_LOSS, e.value.details()
        else:
            reply = stub["b"].PullBlocks(request, timeout=15)
            assert reply.transport == "shared_memory" and reply.bytes == 3 * trio["block"]
            assert read(stub["b"], [60, 61, 62], layout, b.epoch) == read(stub["a"], [1, 2, 3], layout, a.epoch)
    finally:
        shared_cache.remove(other)
        a.close()
        b.close()


class MappedFake(executor_pb2_grpc.ExecutorServicer):
    """A peer whose ReadBlocksMapped misbehaves; its ReadBlocks hands over the real blocks, unchanged."""

    def __init__(self, real_stub, layout: str, mode: str, trio):
        self.real, self.layout, self.mode, self.trio = real_stub, layout, mode, trio

    async def ReadBlocks(self, request, context):
        for chunk in self.real.ReadBlocks(executor_pb2.ReadBlocksRequest(blocks=request.blocks,
                                                                         kv_layout=self.layout, epoch=request.epoch)):
            yield chunk

    async def ReadBlocksMapped(self, request, context):
        if self.mode == "a name outside the directory":
            yield executor_pb2.MappedChunk(file=executor_pb2.CacheFile(name="../../../etc/passwd", num_blocks=4))
            await asyncio.sleep(1)
            return
        where = self.trio["elsewhere" if self.mode == "a file of another host" else "shared"]
        size = 2 if self.mode == "a block past its cache" else 4
        block = self.trio["block"]
        segment = shared_cache.Segment.create(str(where), size * block)
        try:
            segment.map[:] = b"\x07" * (size * block)
            blocks = 8 if self.mode == "a file shorter than it says" else size
            yield executor_pb2.MappedChunk(file=executor_pb2.CacheFile(
                name=segment.name, num_blocks=blocks, chunk_blocks=0 if self.mode == "empty chunks" else 8))
            chunk = executor_pb2.BlockChunk(first=0, count=2, xxh3=12345)     # the pull's two blocks, one chunk
            if self.mode == "bytes in a chunk":
                chunk.data = b"\x07" * block
            elif self.mode == "a chunk out of order":
                chunk.first = 1
            yield executor_pb2.MappedChunk(chunk=chunk)
            await asyncio.sleep(1)
        finally:
            shared_cache.remove(segment)


@pytest.mark.parametrize("mode, code", [("a name outside the directory", None),
                                        ("a file of another host", None),
                                        ("a file shorter than it says", None),
                                        ("a block past its cache", grpc.StatusCode.DATA_LOSS),
                                        ("a bad digest", grpc.StatusCode.DATA_LOSS),
                                        ("bytes in a chunk", grpc.StatusCode.DATA_LOSS),
                                        ("a chunk out of order", grpc.StatusCode.DATA_LOSS),
                                        ("empty chunks", grpc.StatusCode.DATA_LOSS)])
def test_a_hostile_source_is_read_through_grpc_or_refused_and_its_blocks_never_count(trio, mode, code):
    """Refused, the pull fails: whatever it wrote is in blocks the scheduler frees unread (test_kv_move_failures)."""
    stub, layout = trio["stub"], trio["layout"]
    a = filled(trio)
    b = Stream(stub["b"], fresh_epoch())
    b.send()
    address, stop = serve_fake(MappedFake(stub["a"], layout, mode, trio))
    try:
        if code is None:
            # The reader does not map it, and reads the blocks through ReadBlocks instead.
            reply = pull(stub["b"], address, [1, 3], [50, 51], layout, b.epoch, a.epoch)
            assert reply.transport == "grpc"
            assert read(stub["b"], [50, 51], layout, b.epoch) == read(stub["a"], [1, 3], layout, a.epoch)
        else:
            with pytest.raises(grpc.RpcError) as e:
                pull(stub["b"], address, [1, 3], [50, 51], layout, b.epoch, a.epoch)
            assert e.value.code() == code, e.value.details()
    finally:
        stop()
        a.close()
        b.close()


def engines_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(k) for k in f.read().split()]
    return [k for k in kids if b"copy_worker" in open(f"/proc/{k}/cmdline", "rb").read()]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_an_executor_that_stops_or_is_killed_leaves_no_copy_engine_and_its_file_goes(tmp_path, how):
    """Its engine reads the end of its pipe and ends; a killed executor's file is swept by the next one."""
    import time
    model = write_tiny_llama(tmp_path / "llama")
    shm = tmp_path / "shm"
    shm.mkdir()
    flags = {"--model": model, "--block-size": 4, "--kv-cache-memory": kv_bytes(16), "--metrics-address": "",
             "--threads": 1, "--kv-shared-memory-dir": shm}
    with Stack([Service("executor", "a", flags=flags)], tmp_path) as stack:
        pid = stack.procs["a"].pid
        (engine,) = engines_of(pid)
        assert len(list(shm.iterdir())) == 1
        if how == "SIGTERM":
            stack.terminate("a")
            stack.wait("a")
        else:
            stack.kill("a")
        deadline = time.monotonic() + 10
        while not gone(engine) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(engine)
    if how == "SIGTERM":
        assert not list(shm.iterdir())
    else:
        with Stack([Service("executor", "b", flags=flags)], tmp_path) as stack:
            assert len(list(shm.iterdir())) == 1          # its own: the dead one's was swept
