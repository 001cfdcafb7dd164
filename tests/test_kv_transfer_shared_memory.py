"""KV blocks between executors on one host go through shared memory (executor_service/shared_blocks.py), on real
executor processes of the tiny model: the same bytes as through gRPC; gRPC where the segment cannot be mapped;
hostile readers and sources refused with a clear status, nothing written, no slot lost and no file left."""

import asyncio
import queue
import time

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("torch")

from test_executor_server import fresh_epoch  # noqa: E402
from test_kv_transfer_executor import Stream, prefill_and_decode, pull, read, serve_fake  # noqa: E402
from tiny_model import kv_bytes, write_tiny_llama  # noqa: E402

from executor_service.shared_blocks import Segment  # noqa: E402
from launcher.processes import Service, Stack  # noqa: E402
from stepwire.internal import executor_pb2, executor_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """a and b share a shared-memory directory (one host); c has its own (as a pod with its own /dev/shm)."""
    tmp = tmp_path_factory.mktemp("shm")
    model = write_tiny_llama(tmp / "llama")
    shared, own = tmp / "shared", tmp / "own"
    shared.mkdir()
    own.mkdir()
    flags = {"--model": model, "--block-size": 4, "--kv-cache-memory": kv_bytes(64), "--max-num-seqs": 8,
             "--max-model-len": 128, "--metrics-address": "", "--threads": 1}
    with Stack([Service("executor", "a", flags={**flags, "--kv-shared-memory-dir": shared}),
                Service("executor", "b", flags={**flags, "--kv-shared-memory-dir": shared}),
                Service("executor", "c", flags={**flags, "--kv-shared-memory-dir": own})], tmp) as stack:
        chans = {n: grpc.insecure_channel(stack[n].address) for n in "abc"}
        stubs = {n: executor_pb2_grpc.ExecutorStub(c) for n, c in chans.items()}
        yield {"stack": stack, "stub": stubs, "shared": shared, "own": own,
               "layout": stubs["a"].Describe(executor_pb2.DescribeRequest()).kv_layout}
        for c in chans.values():
            c.close()
    # Each executor removes its segment when it stops: nothing is left in either directory.
    assert not list(shared.iterdir()) and not list(own.iterdir())


def filled_source(trio) -> Stream:
    """a's Step stream, with PROMPT's KV in its blocks 1..7 (not zeros, so that a wrong copy shows)."""
    a = Stream(trio["stub"]["a"], fresh_epoch())
    prefill_and_decode(a, list(range(1, 10)), decode=0)
    return a


@pytest.mark.parametrize("target, transport", [("b", "shared_memory"), ("c", "grpc")])
def test_a_pull_goes_through_shared_memory_where_the_segment_maps_and_through_grpc_where_not(trio, target,
                                                                                           transport):
    stub, layout = trio["stub"], trio["layout"]
    a = filled_source(trio)
    t = Stream(stub[target], fresh_epoch())
    t.send()
    src, dst = [1, 2, 3, 4, 5, 6, 7], [20, 21, 22, 23, 24, 25, 26]
    reply = pull(stub[target], trio["stack"]["a"].address, src, dst, layout, t.epoch, a.epoch)
    assert reply.transport == transport
    assert read(stub[target], dst, layout, t.epoch) == read(stub["a"], src, layout, a.epoch)
    a.close()
    t.close()


def test_a_source_whose_segment_the_reader_cannot_map_is_read_through_grpc(trio):
    stub, layout = trio["stub"], trio["layout"]
    c = Stream(stub["c"], fresh_epoch())
    prefill_and_decode(c, list(range(1, 10)), decode=0)
    b = Stream(stub["b"], fresh_epoch())
    b.send()
    reply = pull(stub["b"], trio["stack"]["c"].address, [1, 2, 3], [30, 31, 32], layout, b.epoch, c.epoch)
    assert reply.transport == "grpc"
    assert read(stub["b"], [30, 31, 32], layout, b.epoch) == read(stub["c"], [1, 2, 3], layout, c.epoch)
    c.close()
    b.close()


class Reader:
    """A raw ReadBlocksShared call, driven message by message."""

    def __init__(self, stub, timeout=5):
        self.q = queue.Queue()
        self.replies = stub.ReadBlocksShared(iter(self.q.get, None), timeout=timeout)

    def send(self, **kind):
        self.q.put(executor_pb2.SharedRead(**kind))

    def close(self):
        self.q.put(None)


def a_pull_still_goes_through_shared_memory(trio) -> None:
    """More pulls than the segment has slots: none may find them gone (lent to a reader that left)."""
    stub, layout = trio["stub"], trio["layout"]
    a = filled_source(trio)
    b = Stream(stub["b"], fresh_epoch())
    b.send()
    for i in range(8):
        reply = pull(stub["b"], trio["stack"]["a"].address, [1, 2], [40 + 2 * i, 41 + 2 * i], layout, b.epoch,
                     a.epoch)
        assert reply.transport == "shared_memory"
    a.close()
    b.close()


@pytest.mark.parametrize("case", ["not a request first", "a slot never lent", "a bad block id"])
def test_a_reader_that_breaks_the_protocol_is_refused_and_takes_no_slot_with_it(trio, case):
    stub, layout = trio["stub"], trio["layout"]
    a = filled_source(trio)
    r = Reader(stub["a"])
    with pytest.raises(grpc.RpcError) as e:
        if case == "not a request first":
            r.send(mapped=True)
        elif case == "a bad block id":
            r.send(request=executor_pb2.ReadBlocksRequest(blocks=[0, 2], kv_layout=layout, epoch=a.epoch))
        else:
            r.send(request=executor_pb2.ReadBlocksRequest(blocks=[1, 2], kv_layout=layout, epoch=a.epoch))
            first = next(r.replies)
            assert first.WhichOneof("kind") == "segment"
            r.send(mapped=True)
            r.send(done_slot=first.segment.slots - 1)        # its ring is slot 0 alone: one chunk
        list(r.replies)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    r.close()
    a.close()
    a_pull_still_goes_through_shared_memory(trio)


@pytest.mark.parametrize("case", ["silent after the segment", "gone after the first chunk"])
def test_a_reader_that_stops_answering_or_leaves_gives_its_slots_back(trio, case):
    stub, layout = trio["stub"], trio["layout"]
    a = filled_source(trio)
    slots = None
    for _ in range(5):        # more readers than the segment has slots (4: the whole cache at once, and one)
        r = Reader(stub["a"], timeout=1)
        r.send(request=executor_pb2.ReadBlocksRequest(blocks=list(range(1, 8)), kv_layout=layout, epoch=a.epoch))
        first = next(r.replies)
        assert first.WhichOneof("kind") == "segment"
        slots = first.segment.slots
        if case == "gone after the first chunk":
            r.send(mapped=True)
            assert next(r.replies).WhichOneof("kind") == "chunk"
            r.replies.cancel()
        with pytest.raises(grpc.RpcError):
            list(r.replies)
        r.close()
    assert slots == 4                 # each reader held one slot: had they kept them, the last found none
    a.close()
    time.sleep(0.5)
    a_pull_still_goes_through_shared_memory(trio)


class SharedFake(executor_pb2_grpc.ExecutorServicer):
    """A peer whose ReadBlocksShared misbehaves; its ReadBlocks hands over the real blocks, unchanged."""

    def __init__(self, real_stub, layout: str, mode: str, directory):
        self.real, self.layout, self.mode, self.directory = real_stub, layout, mode, directory

    async def ReadBlocks(self, request, context):
        for chunk in self.real.ReadBlocks(executor_pb2.ReadBlocksRequest(blocks=request.blocks,
                                                                         kv_layout=self.layout, epoch=request.epoch)):
            yield chunk

    async def ReadBlocksShared(self, request_iterator, context):
        requests = request_iterator.__aiter__()
        await anext(requests)
        if self.mode == "a name outside the directory":
            yield executor_pb2.SharedChunk(segment=executor_pb2.SharedSegment(name="../../../etc/passwd", slots=4,
                                                                               slot_bytes=4096))
            await anext(requests, None)
            return
        segment = Segment.create(str(self.directory), 4, 1 << 16)
        try:
            yield executor_pb2.SharedChunk(segment=executor_pb2.SharedSegment(name=segment.path.name, slots=4,
                                                                               slot_bytes=1 << 16))
            await anext(requests)
            slot = 99 if self.mode == "a slot out of range" else 0
            segment.slot(0, 1 << 16)[:] = b"\x07" * (1 << 16)
            yield executor_pb2.SharedChunk(slot=slot, chunk=executor_pb2.BlockChunk(first=0, count=1, xxh3=12345))
            await asyncio.sleep(1)
        finally:
            segment.path.unlink()
            segment.close()


@pytest.mark.parametrize("mode, code", [("a name outside the directory", None),
                                        ("a slot out of range", grpc.StatusCode.DATA_LOSS),
                                        ("a bad digest", grpc.StatusCode.DATA_LOSS)])
def test_a_hostile_source_writes_nothing_and_a_name_outside_the_directory_is_not_opened(trio, mode, code):
    stub, layout = trio["stub"], trio["layout"]
    a = filled_source(trio)
    b = Stream(stub["b"], fresh_epoch())
    b.send()
    before = read(stub["b"], [50], layout, b.epoch)
    address, stop = serve_fake(SharedFake(stub["a"], layout, mode, trio["shared"]))
    try:
        if code is None:
            # The reader refuses to map it and reads the blocks through ReadBlocks instead.
            reply = pull(stub["b"], address, [1], [50], layout, b.epoch, a.epoch)
            assert reply.transport == "grpc"
            assert read(stub["b"], [50], layout, b.epoch) == read(stub["a"], [1], layout, a.epoch)
        else:
            with pytest.raises(grpc.RpcError) as e:
                pull(stub["b"], address, [1], [50], layout, b.epoch, a.epoch)
            assert e.value.code() == code, e.value.details()
            assert read(stub["b"], [50], layout, b.epoch) == before
    finally:
        stop()
        a.close()
        b.close()
