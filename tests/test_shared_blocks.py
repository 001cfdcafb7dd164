"""The source's side of KV blocks through shared memory (executor_service/shared_blocks.py), in process: a
reader that stalls or hands back a slot it does not hold loses the read, and the ring always comes back; the
directory is everyone's, so what is in it is checked before it is opened, swept or mapped."""

import asyncio
import os
import threading

import pytest

from executor_service.shared_blocks import BadAck, Lender, Segment, SlowReader, send, sweep
from stepwire.internal import executor_pb2


class Metrics:
    class _C:
        def inc(self, n=1):
            pass
    kv_blocks_out = kv_bytes_out = _C()


def reader(*messages, then_wait=True):
    async def gen():
        for m in messages:
            yield m
        if then_wait:
            await asyncio.sleep(3600)
    return gen()


async def fill(part, buffer):
    buffer[:] = b"\x01" * len(buffer)
    return 7


async def drain(gen):
    return [m async for m in gen]


@pytest.mark.parametrize("case", ["silent before mapping", "silent after the last chunk", "a slot never lent"])
def test_a_reader_that_stalls_or_lies_loses_the_read_and_the_ring_comes_back(tmp_path, case):
    lender = Lender(str(tmp_path), block_size=1024, num_blocks=64)
    free = list(lender.free)
    mapped = executor_pb2.SharedRead(mapped=True)
    requests = {"silent before mapping": reader(),
                "silent after the last chunk": reader(mapped),
                "a slot never lent": reader(mapped, executor_pb2.SharedRead(done_slot=lender.segment.slots - 1),
                                            then_wait=False)}[case]
    gen = send(requests, list(range(1, 9)), lender, 1024, fill, Metrics(), seconds=0.3)
    with pytest.raises(BadAck if case == "a slot never lent" else SlowReader):
        asyncio.run(drain(gen))
    assert sorted(lender.free) == sorted(free)
    lender.close()
    assert not list(tmp_path.iterdir())


def test_a_reader_that_hands_every_slot_back_and_closes_ends_the_read_cleanly(tmp_path):
    lender = Lender(str(tmp_path), block_size=1024, num_blocks=64)
    free = list(lender.free)
    per = lender.per_slot
    ids = list(range(1, 3 * per + 1))        # three chunks

    async def run():
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(executor_pb2.SharedRead(mapped=True))

        async def requests():
            while (m := await q.get()) is not None:
                yield m
        got = []
        async for msg in send(requests(), ids, lender, 1024, fill, Metrics(), seconds=5):
            got.append(msg)
            if msg.WhichOneof("kind") == "chunk":
                last = msg.chunk.first + msg.chunk.count >= len(ids)
                q.put_nowait(None if last else executor_pb2.SharedRead(done_slot=msg.slot))
        return got

    got = asyncio.run(run())
    assert got[0].WhichOneof("kind") == "segment"
    assert [m.chunk.first for m in got[1:]] == [0, per, 2 * per] and all(m.chunk.xxh3 == 7 for m in got[1:])
    assert sorted(lender.free) == sorted(free)
    lender.close()


def test_a_sweep_removes_segments_nobody_holds_and_leaves_live_ones_fifos_and_strangers_alone(tmp_path):
    live = Lender(str(tmp_path), block_size=1024, num_blocks=64)
    dead = tmp_path / f"stepwire-kv-{'a' * 32}"
    dead.write_bytes(b"\0" * 4096)
    fifo = tmp_path / f"stepwire-kv-{'b' * 32}"
    os.mkfifo(fifo)
    other = tmp_path / "stepwire-kv-not-ours"
    other.write_bytes(b"x")
    done = threading.Event()
    threading.Thread(target=lambda: (sweep(str(tmp_path)), done.set()), daemon=True).start()
    assert done.wait(10), "the sweep waited on a FIFO"
    assert not dead.exists() and fifo.exists() and other.exists() and live.segment.path.exists()
    live.close()


@pytest.mark.parametrize("case", ["a FIFO", "too large", "not blocks", "an odd name"])
def test_a_reader_maps_only_a_regular_file_of_ours_of_a_size_our_own_segment_could_have(tmp_path, case):
    name = f"stepwire-kv-{'c' * 32}"
    slots, slot_bytes = 4, {"too large": 64 << 20, "not blocks": 8000}.get(case, 8192)
    if case == "a FIFO":
        os.mkfifo(tmp_path / name)
    else:           # the size it announces: only the checks of the announcement itself refuse it
        with open(tmp_path / name, "wb") as f:
            f.truncate(slots * slot_bytes)
    assert Segment.open(str(tmp_path), name, 4, 8192, 1024) if case == "an odd name" else True
    with pytest.raises(ValueError):
        Segment.open(str(tmp_path), "../" + name if case == "an odd name" else name, slots, slot_bytes, 1024)
