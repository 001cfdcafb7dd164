"""KV blocks pulled executor to executor (PullBlocks, ReadBlocks), on two real executor processes of the tiny model:
pulled blocks continue a request exactly; a bad checksum, a stalled or unreachable source, a stale epoch, a
foreign layout or hostile ids end the pull with a clear status and write nothing that could be read."""

import asyncio
import queue
import threading
import time

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("torch")

from test_executor_server import fresh_epoch  # noqa: E402
from tiny_model import kv_bytes, reference_greedy, write_tiny_llama  # noqa: E402

from launcher.processes import Service, Stack  # noqa: E402
from stepwire.internal import executor_pb2, executor_pb2_grpc, sampling_pb2  # noqa: E402

pytestmark = pytest.mark.processes

PROMPT = list(range(20, 45))          # 25 tokens: 6 full blocks of 4 and one partial
GREEDY = sampling_pb2.SamplingParams(max_tokens=10, top_p=1.0, ignore_eos=True)


def _pair(tmp, quantization: str):
    model = write_tiny_llama(tmp / "llama")
    # A directory of their own to share: the test holds wherever the machine's /dev/shm is small or full.
    flags = {"--model": model, "--block-size": 4, "--kv-cache-memory": kv_bytes(64), "--max-num-seqs": 8,
             "--max-model-len": 128, "--metrics-address": "", "--threads": 1, "--kv-shared-memory-dir": tmp,
             "--quantization": quantization}
    with Stack([Service("executor", "a", flags=dict(flags)), Service("executor", "b", flags=dict(flags))],
               tmp) as stack:
        chans = {n: grpc.insecure_channel(stack[n].address) for n in ("a", "b")}
        yield {"model": model, "stack": stack,
               "expected": reference_greedy(model, [PROMPT], 10, quantization=quantization)[0],
               "stub": {n: executor_pb2_grpc.ExecutorStub(c) for n, c in chans.items()},
               "layout": executor_pb2_grpc.ExecutorStub(chans["a"]).Describe(executor_pb2.DescribeRequest()).kv_layout}
        for c in chans.values():
            c.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    yield from _pair(tmp_path_factory.mktemp("kv"), "none")


@pytest.fixture(scope="module")
def int8_pair(tmp_path_factory):
    """Two executors whose weights are quantized at load (int8): their KV moves as any other's."""
    pytest.importorskip("gguf")
    yield from _pair(tmp_path_factory.mktemp("kv8"), "int8")


class Stream:
    """A Step stream that names its epoch in its metadata, as the scheduler's does."""

    def __init__(self, stub, epoch: int):
        self.epoch, self.step, self._q = epoch, 0, queue.Queue()
        self._replies = stub.Step(iter(self._q.get, None), metadata=(("stepwire-epoch", str(epoch)),))

    def send(self, **fields) -> executor_pb2.StepResponse:
        self._q.put(executor_pb2.StepRequest(epoch=self.epoch, step=self.step, **fields))
        self.step += 1
        reply = next(self._replies)
        assert not reply.HasField("resync"), reply.resync.reason
        return reply

    def close(self):
        self._q.put(None)


def prefill_and_decode(stream: Stream, blocks: list[int], decode: int) -> list[int]:
    """PROMPT as handle 0 in `blocks`, then `decode` more steps; returns the tokens sampled."""
    new = executor_pb2.NewRequest(handle=0, prompt_token_ids=PROMPT, params=GREEDY, block_ids=blocks)
    out = list(stream.send(new_requests=[new], handles=[0], num_tokens=[len(PROMPT)]).token_ids)
    for _ in range(decode):
        out += stream.send(handles=[0]).token_ids
    return out


def read(stub, blocks: list[int], layout: str, epoch: int) -> bytes:
    """The blocks' bytes, as a peer reads them: named under the executor's current Step stream epoch."""
    return b"".join(c.data for c in stub.ReadBlocks(executor_pb2.ReadBlocksRequest(
        blocks=blocks, kv_layout=layout, epoch=epoch), timeout=10))


def pull(stub, source: str, src: list[int], dst: list[int], layout: str, epoch: int, source_epoch: int,
         after: int = -1, timeout=10):
    return stub.PullBlocks(executor_pb2.PullBlocksRequest(
        transfer_id="t", source=source, source_blocks=src, target_blocks=dst, kv_layout=layout, epoch=epoch,
        after_step=after, source_epoch=source_epoch, deadline_seconds=timeout), timeout=timeout + 5)


@pytest.mark.parametrize("weights", ["pair", "int8_pair"])
def test_blocks_pulled_from_a_peer_continue_the_request_as_if_it_had_never_moved(request, weights):
    pair = request.getfixturevalue(weights)
    stub, layout, expected = pair["stub"], pair["layout"], pair["expected"]
    assert layout.endswith(":int8") == (weights == "int8_pair")
    a, b = Stream(stub["a"], fresh_epoch()), Stream(stub["b"], fresh_epoch())
    src = list(range(1, 10))
    got = prefill_and_decode(a, src, decode=3)                 # 4 tokens out: 28 tokens of KV computed
    computed = len(PROMPT) + len(got) - 1
    moved = -(-computed // 4)
    dst = list(range(40, 40 + moved))
    reply = pull(stub["b"], pair["stack"]["a"].address, src[:moved], dst, layout, b.epoch, a.epoch)
    assert reply.transport == "shared_memory"                  # both executors on this host, one directory
    assert reply.bytes == len(read(stub["a"], src[:moved], layout, a.epoch)) > 0
    assert read(stub["b"], dst, layout, b.epoch) == read(stub["a"], src[:moved], layout, a.epoch)
    # B goes on from the pulled KV alone: only the last sampled token is computed, and the tokens are A's.
    new = executor_pb2.NewRequest(handle=5, prompt_token_ids=PROMPT, output_token_ids=got, params=GREEDY,
                                  block_ids=dst + [60, 61], num_computed_tokens=computed)
    rest = list(b.send(new_requests=[new], handles=[5], num_tokens=[1]).token_ids)
    for _ in range(len(expected) - len(got) - 1):
        rest += b.send(handles=[5]).token_ids
    assert got + rest == expected
    a.close()
    b.close()


def test_a_pull_waits_for_the_last_step_that_could_write_its_blocks(pair):
    stub, layout = pair["stub"], pair["layout"]
    a, b = Stream(stub["a"], fresh_epoch()), Stream(stub["b"], fresh_epoch())
    b.send()                                                    # step 0 ran
    done = []
    t = threading.Thread(target=lambda: done.append(pull(stub["b"], pair["stack"]["a"].address, [1], [50], layout,
                                                         b.epoch, a.epoch, after=1)))
    t.start()
    time.sleep(1.0)
    assert not done                                             # step 1 was sent before the blocks were reserved
    b.send()
    t.join(10)
    assert done and done[0].bytes > 0
    a.close()
    b.close()


def test_a_prefix_read_waits_for_the_step_that_fills_its_blocks_and_ends_with_the_stream(pair):
    stub, layout = pair["stub"], pair["layout"]
    a = Stream(stub["a"], fresh_epoch())
    a.send()                                                    # step 0 ran
    got, errors = [], []

    def read_after(step):
        try:
            got.append(b"".join(c.data for c in stub["a"].ReadBlocks(executor_pb2.ReadBlocksRequest(
                blocks=[1, 2], kv_layout=layout, epoch=a.epoch, after_step=step), timeout=10)))
        except grpc.RpcError as e:
            errors.append(e.code())

    t = threading.Thread(target=read_after, args=(1,))
    t.start()
    time.sleep(1.0)
    assert not got and not errors                               # step 1 may still fill blocks 1 and 2
    a.send()
    t.join(10)
    assert len(got) == 1 and len(got[0]) > 0 and not errors
    t = threading.Thread(target=read_after, args=(5,))
    t.start()
    time.sleep(0.5)
    b = Stream(stub["a"], fresh_epoch())                        # a new stream: the blocks may hold anything now
    b.send()
    t.join(10)
    assert errors == [grpc.StatusCode.ABORTED] and len(got) == 1
    a.close()
    b.close()


@pytest.mark.parametrize("case", ["stale epoch", "foreign layout", "null block", "twice", "lengths", "address",
                                  "stale source"])
def test_a_bad_pull_is_refused_and_writes_nothing(pair, case):
    stub, layout = pair["stub"], pair["layout"]
    a, b = Stream(stub["a"], fresh_epoch()), Stream(stub["b"], fresh_epoch())
    b.send()
    before = read(stub["b"], [20, 21], layout, b.epoch)
    args = {"source": pair["stack"]["a"].address, "src": [1, 2], "dst": [20, 21], "layout": layout, "epoch": b.epoch,
            "source_epoch": a.epoch}
    args |= {"stale epoch": {"epoch": b.epoch - 1}, "foreign layout": {"layout": layout + "x"},
             "null block": {"dst": [0, 21]}, "twice": {"dst": [21, 21]}, "lengths": {"dst": [20]},
             "address": {"source": "no port"}, "stale source": {"source_epoch": a.epoch - 1}}[case]
    with pytest.raises(grpc.RpcError) as e:
        pull(stub["b"], **args)
    stale = grpc.StatusCode.FAILED_PRECONDITION
    # A source refuses a read under another epoch than its stream's: the pull ends without a byte.
    expected = {"stale epoch": stale, "foreign layout": stale,
                "stale source": grpc.StatusCode.UNAVAILABLE}.get(case, grpc.StatusCode.INVALID_ARGUMENT)
    assert e.value.code() == expected, e.value.details()
    # The executor said so itself: nothing of the pull goes on, the scheduler may reuse the blocks at once.
    assert dict(e.value.trailing_metadata())["stepwire-pull-ended"] == "1"
    assert read(stub["b"], [20, 21], layout, b.epoch) == before
    a.close()
    b.close()


@pytest.mark.parametrize("ids", [[0], [64], [3, 3], []])
def test_reading_blocks_that_do_not_exist_is_refused(pair, ids):
    with pytest.raises(grpc.RpcError) as e:
        read(pair["stub"]["a"], ids, pair["layout"], 0) if ids else list(pair["stub"]["a"].ReadBlocks(
            executor_pb2.ReadBlocksRequest(blocks=[1], kv_layout="other"), timeout=5))
    assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


class FakeSource(executor_pb2_grpc.ExecutorServicer):
    """A peer that answers ReadBlocks wrongly: a flipped byte under a good digest, or nothing for ever."""

    def __init__(self, real_stub, layout: str, mode: str):
        self.real, self.layout, self.mode = real_stub, layout, mode

    async def ReadBlocks(self, request, context):
        if self.mode == "stall":
            await asyncio.sleep(3600)
        chunks = list(self.real.ReadBlocks(executor_pb2.ReadBlocksRequest(blocks=request.blocks,
                                                                          kv_layout=self.layout, epoch=request.epoch)))
        first = chunks[0]
        data = bytearray(first.data)
        data[len(data) // 2] ^= 0xFF
        yield executor_pb2.BlockChunk(first=first.first, count=first.count, data=bytes(data), xxh3=first.xxh3)


def serve_fake(fake) -> tuple[str, callable]:
    loop = asyncio.new_event_loop()
    started, holder = threading.Event(), {}

    async def main():
        server = grpc.aio.server()
        executor_pb2_grpc.add_ExecutorServicer_to_server(fake, server)
        holder["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        holder["server"] = server
        started.set()
        await server.wait_for_termination()

    t = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    t.start()
    started.wait(10)
    return f"127.0.0.1:{holder['port']}", lambda: asyncio.run_coroutine_threadsafe(holder["server"].stop(0), loop)


@pytest.mark.parametrize("mode", ["corrupt", "stall"])
def test_a_corrupt_or_stalled_source_fails_the_pull_and_the_bad_block_is_not_written(pair, mode):
    stub, layout = pair["stub"], pair["layout"]
    a = Stream(stub["a"], fresh_epoch())
    prefill_and_decode(a, list(range(1, 10)), decode=0)       # A's blocks 1..7 hold KV, not zeros
    b = Stream(stub["b"], fresh_epoch())
    b.send()
    before = read(stub["b"], [30, 31], layout, b.epoch)
    address, stop = serve_fake(FakeSource(stub["a"], layout, mode))
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            pull(stub["b"], address, [1, 2], [30, 31], layout, b.epoch, a.epoch, timeout=3)
        assert e.value.code() == (grpc.StatusCode.DATA_LOSS if mode == "corrupt" else
                                  grpc.StatusCode.DEADLINE_EXCEEDED), e.value.details()
        assert time.monotonic() - t0 < 30
        # The target's own deadline ended the stalled pull, and it said it stopped writing.
        assert dict(e.value.trailing_metadata()).get("stepwire-pull-ended") == "1"
        assert read(stub["b"], [30, 31], layout, b.epoch) == before
    finally:
        stop()
        a.close()
        b.close()


def test_a_new_step_stream_stops_a_pull_of_the_old_one(pair):
    stub, layout = pair["stub"], pair["layout"]
    b = Stream(stub["b"], fresh_epoch())
    b.send()
    address, stop = serve_fake(FakeSource(stub["a"], layout, "stall"))
    errors = []

    def run():
        try:
            pull(stub["b"], address, [1], [33], layout, b.epoch, 0, timeout=30)
        except grpc.RpcError as e:
            errors.append(e)

    try:
        t = threading.Thread(target=run)
        t.start()
        time.sleep(1.0)
        b2 = Stream(stub["b"], fresh_epoch())       # a restarted scheduler: what the old one reserved is void
        b2.send()
        t.join(20)
        assert not t.is_alive() and errors and errors[0].code() == grpc.StatusCode.ABORTED, errors
        b2.close()
    finally:
        stop()
