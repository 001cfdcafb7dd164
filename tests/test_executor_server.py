"""The executor service as a real process on a loopback port: health, Describe, the Step stream, resync."""

import queue
import time

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("torch")

from tiny_model import executor_dtype, kv_bytes, reference_greedy, write_tiny_llama  # noqa: E402

from launcher.processes import Service, Stack  # noqa: E402
from scheduler_service import Request, Scheduler, SchedulerConfig  # noqa: E402
from scheduler_service.fleet.wire import HandleTable, decode_result, encode_step  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402
from stepwire.internal import executor_pb2, executor_pb2_grpc, sampling_pb2  # noqa: E402

# 64 blocks in the dtype the executor runs (the environment's: its Describe says which).
DTYPE = executor_dtype()
KV_BYTES = kv_bytes(64, dtype=DTYPE)


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


def fresh_epoch() -> int:
    """Epochs only move forward on an executor; a clock reading is above any a previous test used."""
    return time.monotonic_ns()


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    model = write_tiny_llama(tmp / "llama")
    # Stopped at the end, failing if it exited during the tests.
    with Stack([Service("executor", flags={"--model": model, "--block-size": 4, "--kv-cache-memory": KV_BYTES,
                                           "--max-num-seqs": 8, "--max-model-len": 128})], tmp) as stack, \
            grpc.insecure_channel(stack["executor"].address) as channel:
        yield model, channel


class StepStream:
    """A Step stream driven one message at a time."""

    def __init__(self, channel):
        self._q: queue.Queue = queue.Queue()
        self._responses = executor_pb2_grpc.ExecutorStub(channel).Step(iter(self._q.get, None))

    def send(self, msg):
        self._q.put(msg)
        return next(self._responses)

    def close(self):
        self._q.put(None)


def test_describe_reports_the_model_and_the_kv_capacity(executor):
    model, channel = executor
    d = executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest(), timeout=5)
    assert (d.architecture, d.dtype, d.block_size, d.num_blocks, d.max_model_len, d.vocab_size) == \
        ("LlamaForCausalLM", DTYPE, 4, 64, 128, 97)
    assert (d.max_num_seqs, d.tensor_parallel_size) == (8, 1)
    assert d.max_num_batched_tokens == 8192      # the default cap on a step's tokens, past this context
    assert d.instance_id


def test_steps_over_the_wire_generate_what_the_in_process_engine_generates(executor):
    model, channel = executor
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 45))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = reference_greedy(model, prompts)

    sched = Scheduler(SchedulerConfig(block_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=16),
                      num_blocks=64)
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"r{i}", p, params))
    handles, stream, got = HandleTable(), StepStream(channel), {}
    step, epoch = 0, fresh_epoch()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        msg, order = encode_step(out, handles, epoch=epoch, step=step)
        reply = stream.send(msg)
        assert not reply.HasField("resync") and reply.step == step
        for d in sched.update_from_output(out, decode_result(reply, order)):
            got.setdefault(d.req_id, []).extend(d.new_token_ids)
        step += 1
    stream.close()
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected


def test_unknown_handles_and_stale_epochs_get_resync_and_the_stream_goes_on(executor):
    _, channel = executor
    stream, epoch = StepStream(channel), fresh_epoch()
    r = stream.send(executor_pb2.StepRequest(epoch=epoch, step=0, handles=[42]))
    assert r.HasField("resync") and "unknown handles [42]" in r.resync.reason
    r = stream.send(executor_pb2.StepRequest(epoch=epoch - 1, step=1))
    assert r.HasField("resync") and "older" in r.resync.reason
    ok = executor_pb2.NewRequest(handle=0, prompt_token_ids=[3, 4, 5], block_ids=[1],
                                 params=sampling_pb2.SamplingParams(max_tokens=2, top_p=1.0))
    r = stream.send(executor_pb2.StepRequest(epoch=epoch, step=2, new_requests=[ok], handles=[0], num_tokens=[3]))
    assert not r.HasField("resync") and r.all_sampled and len(r.token_ids) == 1
    stream.close()
