"""The source's side of KV blocks through shared memory (executor_service/shared_blocks.py), in process: a
reader that stalls or hands back a slot it does not hold loses the read, and the ring always comes back."""

import asyncio

import pytest

from executor_service.shared_blocks import BadAck, Lender, SlowReader, send
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
