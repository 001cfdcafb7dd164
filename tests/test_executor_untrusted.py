"""The executor treats every field of a Step message as untrusted.

A real executor process gets real steps from a scheduler core, with mutated copies sent before them (handles,
block ids, token ids, counts, epochs, sampling parameters, blocks named twice or held by another row, steps
over the executor's token cap, rows grown past the context, truncated or garbage bytes): it never crashes, a
refused copy changes nothing (the original sent next continues the run to the in-process engine's tokens),
and a real scheduler connected afterwards still matches the engine. Then the cache-poisoning attack on the
plaintext port: a stranger's stream writes junk into the KV blocks of a cached prompt, and the scheduler
must not reuse them.
"""

import contextlib
import logging
import queue
import random
from concurrent.futures import ThreadPoolExecutor
from functools import partial, update_wrapper
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("torch")

from grpc_health.v1 import health_pb2  # noqa: E402
from helpers import grpc_health, log_tail, wait_executor_idle  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tiny_model import TINY, kv_bytes, reference_greedy, write_tiny_llama  # noqa: E402

from executor_service.batch.input_batch import InputBatch  # noqa: E402
from executor_service.batch.step_checks import Limits, check_step  # noqa: E402
from executor_service.batch.wire import decode_step  # noqa: E402
from launcher.processes import Service, Stack  # noqa: E402
from scheduler_service import Request, RunnerOutput, Scheduler, SchedulerConfig  # noqa: E402
from scheduler_service.fleet.wire import HandleTable, decode_result, encode_step  # noqa: E402
from stepwire.contract import SamplingParams  # noqa: E402
from stepwire.internal import executor_pb2, sampling_pb2, scheduler_pb2, scheduler_pb2_grpc  # noqa: E402

VOCAB, NUM_BLOCKS, BLOCK, MAX_LEN, MAX_SEQS, BUDGET = TINY["vocab_size"], 64, 4, 128, 8, 16
# The executor's cap on a step's tokens: room for the stranger's 251-token step below; the scheduler's own
# budget (16) is smaller.
STEP_CAP = 2 * MAX_LEN
LIMITS = Limits(VOCAB, NUM_BLOCKS, BLOCK, MAX_LEN, MAX_SEQS, STEP_CAP)
SCHEDULER_BLOCKS = 12   # the small pool's: the executor's blocks from 12 up are never handed out by it
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(20, 45)), [3, 3, 3, 3, 3, 60, 61, 62, 63, 64, 65, 66]]
TOKENS = 10
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
U32 = 2**32 - 1
MAX_LOGPROBS = 20     # the contract's cap (as vLLM's max_logprobs): more would make a step's reply too large
EPOCH = 1000
DTYPE = "float32"     # the executor's and its reference's: see the executor fixture


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("untrusted")
    model = write_tiny_llama(tmp / "llama")
    # Stopped at the end, failing if it exited during the tests. float32: the runs end with the in-process
    # engine's tokens, computed in batches of other shapes, which bfloat16 rounding cannot promise.
    with Stack([Service("executor", flags={
            "--model": model, "--dtype": DTYPE, "--block-size": BLOCK, "--kv-cache-memory":
            kv_bytes(NUM_BLOCKS, dtype=DTYPE), "--max-num-seqs": MAX_SEQS, "--max-model-len": MAX_LEN,
            "--max-num-batched-tokens": STEP_CAP, "--metrics-address": "", "--threads": 1})], tmp) as stack, \
            grpc.insecure_channel(stack["executor"].address) as channel:
        yield model, stack["executor"].address, channel, stack.procs["executor"], stack.log("executor")


@pytest.fixture(scope="module")
def expected(executor):
    return reference_greedy(executor[0], PROMPTS, max_tokens=TOKENS, budget=BUDGET, dtype=DTYPE)


class StepStream:
    """A Step stream driven one message (or raw bytes) at a time."""

    def __init__(self, channel):
        self._q: queue.Queue = queue.Queue()
        call = channel.stream_stream("/stepwire.internal.Executor/Step",
                                     request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
                                     response_deserializer=executor_pb2.StepResponse.FromString)
        self._responses = call(iter(self._q.get, None), timeout=60)

    def send(self, msg) -> executor_pb2.StepResponse:
        self._q.put(msg)
        return next(self._responses)

    def close(self) -> None:
        self._q.put(None)


def small_pool_scheduler() -> Scheduler:
    """A pool of 12 blocks: the run preempts, resumes, grows and finishes requests, so steps carry every field."""
    sched = Scheduler(SchedulerConfig(block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS,
                                      max_num_batched_tokens=BUDGET), num_blocks=SCHEDULER_BLOCKS)
    for i, p in enumerate(PROMPTS):
        sched.add_request(Request(f"r{i}", p, GREEDY))
    return sched


# ---------------------------------------------------------------------------------------------- mutations
# Each takes a copy of a valid step, the handle table after encoding it, and a hypothesis `draw`; it returns
# the message (or bytes) to send and whether the executor must refuse it. Those that may not be refused
# (bytes that might still parse, a newer epoch) only need a reply that is a result, a resync or a status.

def _new_request(handle, n=3, blocks=(1,), **params):
    sp = sampling_pb2.SamplingParams(max_tokens=4, top_p=1.0, top_k=-1, **params)
    return executor_pb2.NewRequest(handle=handle, prompt_token_ids=[7] * n, params=sp, block_ids=list(blocks))


def bad_token_id(msg, table, draw):
    n = draw(st.sampled_from(msg.new_requests))
    n.prompt_token_ids[draw(st.integers(0, len(n.prompt_token_ids) - 1))] = draw(
        st.sampled_from([VOCAB, U32]) | st.integers(VOCAB, U32))
    return msg, True


def bad_new_block(msg, table, draw):
    n = draw(st.sampled_from([n for n in msg.new_requests if n.block_ids]))
    n.block_ids[draw(st.integers(0, len(n.block_ids) - 1))] = draw(st.sampled_from([0, NUM_BLOCKS, U32]))
    return msg, True


def bad_grown_block(msg, table, draw):
    msg.grown_block_ids[draw(st.integers(0, len(msg.grown_block_ids) - 1))] = draw(
        st.sampled_from([0, NUM_BLOCKS]) | st.integers(NUM_BLOCKS, U32))
    return msg, True


def bad_resumed_block(msg, table, draw):
    msg.resumed_block_ids[draw(st.integers(0, len(msg.resumed_block_ids) - 1))] = draw(st.sampled_from([0, U32]))
    return msg, True


def unknown_handle(msg, table, draw):
    field = draw(st.sampled_from([f for f in ("handles", "preempted", "resumed", "finished") if getattr(msg, f)]))
    getattr(msg, field)[draw(st.integers(0, len(getattr(msg, field)) - 1))] = draw(st.integers(2 * MAX_SEQS, U32))
    return msg, True


def handle_twice(msg, table, draw):
    field = draw(st.sampled_from([f for f in ("handles", "preempted", "finished") if getattr(msg, f)]))
    getattr(msg, field).append(getattr(msg, field)[0])
    if field == "handles" and msg.num_tokens:
        msg.num_tokens.append(1)
    return msg, True


def bad_count(msg, table, draw):
    if not msg.num_tokens:
        msg.num_tokens.extend([1] * len(msg.handles))
    msg.num_tokens[draw(st.integers(0, len(msg.handles) - 1))] = draw(
        st.sampled_from([0, MAX_LEN + 1, U32]) | st.integers(MAX_LEN + 1, U32))
    return msg, True


def lora_without_adapters(msg, table, draw):
    # This executor serves no adapters (--max-loras 0): any LoRA field is refused, a load of any path above all.
    if draw(st.booleans()):
        msg.lora_loads.append(executor_pb2.LoraLoad(slot=draw(st.integers(0, U32)), key="x@1",
                                                    path=draw(st.sampled_from(["/etc", "/", "adapters/x"]))))
    else:
        msg.lora_handles.append(draw(st.integers(0, U32)))
        msg.lora_slots.append(draw(st.integers(0, U32)))
    return msg, True


def counts_of_wrong_length(msg, table, draw):
    # Never none: empty num_tokens means one token each, a valid step.
    msg.num_tokens[:] = [1] * draw(st.integers(1, len(msg.handles) + 3).filter(lambda k: k != len(msg.handles)))
    return msg, True


def bad_grown_fields(msg, table, draw):
    how = draw(st.sampled_from(["index", "counts", "ids"]))
    if how == "index" or not msg.grown:
        msg.grown.append(len(msg.handles) + draw(st.integers(0, U32 - len(msg.handles))))
        msg.grown_block_ids.append(5)
    elif how == "counts":
        msg.grown_block_counts[:] = [c + 1 for c in (msg.grown_block_counts or [1] * len(msg.grown))]
    else:
        msg.grown_block_ids.append(5)
    return msg, True


def bad_resumed_fields(msg, table, draw):
    field = draw(st.sampled_from(["resumed_num_computed", "resumed_block_counts", "resumed_block_ids"]))
    getattr(msg, field).append(1)
    return msg, True


def resumed_computed_too_far(msg, table, draw):
    msg.resumed_num_computed[0] = draw(st.integers(MAX_LEN + 1, U32))
    return msg, True


def new_for_a_held_handle(msg, table, draw):
    msg.new_requests.append(_new_request(draw(st.sampled_from(sorted(table.id_of)))))
    return msg, True


def too_many_rows(msg, table, draw):
    for h in range(100, 100 + MAX_SEQS + 1):
        msg.new_requests.append(_new_request(h))
    return msg, True


def too_many_tokens(msg, table, draw):
    n = draw(st.integers(MAX_LEN + 1, 4 * MAX_LEN))
    msg.new_requests.append(_new_request(100, n=n, blocks=range(1, 2 + n // BLOCK)))
    return msg, True


def uncovered_tokens(msg, table, draw):
    n = draw(st.sampled_from(msg.new_requests))
    if draw(st.booleans()):
        del n.block_ids[:]
    else:
        n.num_computed_tokens = draw(st.integers(len(n.prompt_token_ids) + 1, U32))
    return msg, True


def bad_sampling(msg, table, draw):
    params = draw(st.sampled_from(msg.new_requests)).params
    field, value = draw(st.sampled_from([
        ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -1.0),
        ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("top_k", -2), ("top_k", -2**31),
        ("min_p", float("nan")), ("min_p", 2.0), ("max_tokens", 0), ("min_tokens", U32), ("logprobs", U32),
        ("logprobs", MAX_LOGPROBS + 1)]))
    setattr(params, field, value)
    return msg, True


def odd_but_valid_sampling(msg, table, draw):
    """Within the contract's rules: accepted, and greedy tokens do not change (the run goes on from it)."""
    params = draw(st.sampled_from(msg.new_requests)).params
    field, value = draw(st.sampled_from([("logprobs", MAX_LOGPROBS), ("logprobs", 0), ("top_k", 2**31 - 1),
                                         ("seed", 2**64 - 1), ("min_tokens", TOKENS)]))
    setattr(params, field, value)
    return msg, False


def over_the_step_cap(msg, table, draw):
    """Token counts spread over the scheduled rows, their sum just past the executor's cap or far beyond."""
    total = STEP_CAP + draw(st.integers(1, 4) | st.integers(1, U32 - STEP_CAP))
    share = -(-total // len(msg.handles))
    msg.num_tokens[:] = [min(share, U32)] * len(msg.handles)
    return msg, True


def grown_past_max_model_len(msg, table, draw):
    """A scheduled row handed blocks beyond what a row of the context can hold (blocks nobody else holds)."""
    i = draw(st.sampled_from([i for i in range(len(msg.handles)) if i not in msg.grown]))
    if not msg.grown_block_counts:
        msg.grown_block_counts.extend([1] * len(msg.grown))
    n = MAX_LEN // BLOCK + draw(st.integers(0, 3))
    msg.grown.append(i)
    msg.grown_block_counts.append(n)
    msg.grown_block_ids.extend(range(SCHEDULER_BLOCKS, SCHEDULER_BLOCKS + n))
    return msg, True


def _written_blocks(msg) -> list[tuple[object, int]]:
    """(repeated field, index) of every block id the step hands a row to write: grown blocks, and new rows'
    blocks past their computed tokens."""
    at = [(msg.grown_block_ids, i) for i in range(len(msg.grown_block_ids))]
    for n in msg.new_requests:
        at += [(n.block_ids, i) for i in range(n.num_computed_tokens // BLOCK, len(n.block_ids))]
    return at


def block_twice_in_a_row(msg, table, draw):
    n = draw(st.sampled_from([n for n in msg.new_requests if n.block_ids]))
    if len(n.block_ids) > 1 and draw(st.booleans()):
        i, j = draw(st.lists(st.integers(0, len(n.block_ids) - 1), min_size=2, max_size=2, unique=True))
        n.block_ids[j] = n.block_ids[i]
    else:
        n.block_ids.append(draw(st.sampled_from(n.block_ids)))
    return msg, True


def block_held_by_a_row(msg, table, draw, held):
    """A block handed out to write replaced by one that a row the step keeps holds (a shared prefix, a block
    another row writes, or one of the row's own): two requests' KV in one block."""
    field, i = draw(st.sampled_from(_written_blocks(msg)))
    field[i] = draw(st.sampled_from(sorted(held - {field[i]})))
    return msg, True


def older_epoch(msg, table, draw):
    msg.epoch -= draw(st.integers(1, EPOCH))
    return msg, True


def newer_epoch(msg, table, draw):
    msg.epoch += draw(st.integers(1, 2**64 - 1 - EPOCH))
    return msg, None


def truncated(msg, table, draw):
    data = msg.SerializeToString()
    return data[:draw(st.integers(0, max(0, len(data) - 1)))], None


def flipped_bytes(msg, table, draw):
    data = bytearray(msg.SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data), None


def garbage(msg, table, draw):
    return draw(st.binary(max_size=64)), None


def mutations_for(msg, table, step: int, held: set[int]) -> tuple[list, list]:
    """The mutations that must be refused and apply to this step (a field must be there to be broken): those
    any step allows, and those of the fields few steps carry (new, resumed and grown requests). `held`: the
    blocks held by rows the step keeps (neither added nor dropped by it)."""
    common = [too_many_rows, too_many_tokens, counts_of_wrong_length, lora_without_adapters]
    if step:
        common.append(older_epoch)   # the stream's first step sets its epoch: nothing is older yet
    if msg.handles or msg.finished or msg.preempted:
        common += [unknown_handle, handle_twice]
    if table.id_of:
        common.append(new_for_a_held_handle)
    if msg.handles:
        common += [bad_count, over_the_step_cap]
        if len(msg.grown) < len(msg.handles):
            common.append(grown_past_max_model_len)
    rare = []
    if msg.new_requests:
        rare += [bad_token_id, uncovered_tokens, bad_sampling]
        if any(n.block_ids for n in msg.new_requests):
            rare += [bad_new_block, block_twice_in_a_row]
    if len(held) > 1 and _written_blocks(msg):
        rare.append(update_wrapper(partial(block_held_by_a_row, held=held), block_held_by_a_row))
    if msg.grown_block_ids:
        rare += [bad_grown_block, bad_grown_fields]
    if msg.resumed:
        rare += [unknown_handle, bad_resumed_fields, resumed_computed_too_far]
        if msg.resumed_block_ids:
            rare.append(bad_resumed_block)
    return common, rare


# These may be accepted or refused, and either may change the executor's state: the run ends after one.
ENDING = [newer_epoch, truncated, flipped_bytes, garbage]
REFUSED = [too_many_rows, too_many_tokens, counts_of_wrong_length, lora_without_adapters, older_epoch, unknown_handle,
           handle_twice, new_for_a_held_handle, bad_count, bad_token_id, uncovered_tokens, bad_sampling, bad_new_block,
           bad_grown_block, bad_grown_fields, bad_resumed_fields, resumed_computed_too_far, bad_resumed_block,
           over_the_step_cap, grown_past_max_model_len, block_twice_in_a_row, block_held_by_a_row]


def _result_is_well_formed(reply, msg) -> None:
    assert all(i < len(msg.handles) for i in reply.sampled)
    assert all(t < VOCAB for t in reply.token_ids)


# ---------------------------------------------------------------------------------------------- tests

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.floats(0, 2), st.integers(-1, 5),
                                   st.none() | st.integers(0, 3)), min_size=1, max_size=12),
       num_blocks=st.integers(12, 40), budget=st.integers(4, 48), seed=st.integers(0, 99))
def test_the_checks_accept_every_step_the_scheduler_sends(workload, num_blocks, budget, seed):
    """A refusal costs the scheduler a resync of every request, so a check stricter than the scheduler would
    turn one request into a resync loop: every step of any run (preemption included) must pass."""
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS,
                                      max_num_batched_tokens=budget), num_blocks=num_blocks)
    for i, (n, m, t, k, lp) in enumerate(workload):
        prompt = [rng.randrange(VOCAB) for _ in range(n)]
        if n + m - 1 <= (num_blocks - 1) * BLOCK:
            sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=m, temperature=t, top_k=k, logprobs=lp,
                                                                      seed=i if i % 2 else None, ignore_eos=True)))
    batch, table = InputBatch(MAX_SEQS, MAX_LEN, BLOCK, NUM_BLOCKS), HandleTable()
    for n in range(500):
        out = sched.schedule()
        step = decode_step(encode_step(out, table, epoch=1, step=n)[0])
        check_step(step, batch, LIMITS)
        batch.apply(step)
        if not sched.has_unfinished_requests():
            break
        if not step.handles:
            continue
        inputs = batch.prepare(step.handles, step.num_tokens, step.total_tokens)
        sampled = [rng.randrange(VOCAB) for _ in range(int(inputs.sample_mask.sum()))]
        batch.append_sampled(inputs, sampled)
        it = iter(sampled)
        ids = list(out.num_scheduled_tokens)
        sched.update_from_output(out, RunnerOutput(ids, [[next(it)] if s else [] for s in inputs.sample_mask]))
    assert not sched.has_unfinished_requests()


def test_a_prompt_token_outside_the_vocabulary_gets_resync_and_the_stream_goes_on(executor):
    """The issue's example: token id 4294967295 made every step fail with IndexError, a crash loop."""
    _, _, channel, proc, _ = executor
    stream = StepStream(channel)
    bad = executor_pb2.StepRequest(epoch=EPOCH, step=0, new_requests=[_new_request(0)], handles=[0], num_tokens=[3])
    bad.new_requests[0].prompt_token_ids[1] = U32
    reply = stream.send(bad)
    assert reply.HasField("resync") and f"token id {U32} is outside the vocabulary" in reply.resync.reason
    bad.new_requests[0].prompt_token_ids[1] = VOCAB - 1
    reply = stream.send(bad)
    assert not reply.HasField("resync") and reply.all_sampled and len(reply.token_ids) == 1
    stream.close()
    assert proc.poll() is None


def test_a_failing_step_is_answered_with_resync_and_an_empty_batch(tmp_path, caplog):
    """The last line of defence: whatever escapes the checks is logged with its traceback and answered with a
    resync, the batch reset, and the next step (a newer epoch, as the scheduler sends) runs normally."""
    from executor_service.api.servicer import ExecutorService, _Stream
    from executor_service.engine.runner import ModelRunner
    from executor_service.engine.runner_config import RunnerConfig

    model = write_tiny_llama(tmp_path / "llama")
    runner = ModelRunner(RunnerConfig(str(model), block_size=BLOCK, max_num_seqs=MAX_SEQS,
                                      kv_cache_memory=kv_bytes(NUM_BLOCKS), max_model_len=MAX_LEN))
    service = ExecutorService(None, runner)
    stream = _Stream()
    step = executor_pb2.StepRequest(epoch=1, step=0, new_requests=[_new_request(0)], handles=[0], num_tokens=[3])

    def broken(*args):
        raise RuntimeError("a bug nobody caught")

    runner.batch.prepare = broken
    with caplog.at_level(logging.ERROR, logger="stepwire.executor"):
        reply = service._step(step, stream)
    assert reply.HasField("resync") and "RuntimeError: a bug nobody caught" in reply.resync.reason
    assert any(r.exc_info for r in caplog.records)
    assert runner.batch.num_reqs == 0 and not runner.batch.row_of and runner.batch.prepare is not broken
    again = service._step(executor_pb2.StepRequest(epoch=2, step=1, new_requests=[_new_request(0)], handles=[0],
                                                   num_tokens=[3]), stream)
    assert not again.HasField("resync") and again.all_sampled and len(again.token_ids) == 1


def test_mutated_steps_never_crash_the_executor_and_a_refused_step_changes_nothing(executor, expected, tmp_path):
    """Runs of real steps with mutated copies sent in between: a copy that must be refused gets a resync (from
    the checks, not the last line of defence) and the original sent next goes on as if nothing happened, so
    the run ends with the engine's tokens; bytes that may parse into anything, or a newer epoch, end the run
    with a result, a resync or a clean status. The process stays up and SERVING throughout."""
    model, address, channel, proc, log_path = executor
    seen = {"refused": 0, "accepted": 0, "status": 0, "valid": 0, "kinds": set()}

    def send(stream, mutate, msg, table, draw) -> bool:
        """Send a mutated copy of `msg`; True if the run goes on with `msg` itself."""
        bad, must_refuse = mutate(executor_pb2.StepRequest.FromString(msg.SerializeToString()), table, draw)
        seen["kinds"].add(mutate.__name__)
        try:
            reply = stream.send(bad)
        except grpc.RpcError as e:
            assert must_refuse is not True, f"{mutate.__name__}: {e.code()} instead of a resync"
            seen["status"] += 1
            return False
        if reply.HasField("resync"):
            assert "internal error" not in reply.resync.reason, reply.resync.reason
            seen["refused"] += 1
            return must_refuse is True          # refused, so nothing changed: the original goes next
        assert must_refuse is not True, f"{mutate.__name__} was accepted: {bad}"
        _result_is_well_formed(reply, bad)
        seen["accepted"] += 1
        return False

    @settings(max_examples=20, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data(), end_with=st.sampled_from([None, *ENDING]), end_at=st.integers(0, 26),
           turn=st.integers(0, 30))
    def fuzz(data, end_with, end_at, turn):
        # Epochs belong to a stream, and every example opens its own: the same epoch serves them all.
        sched, table, stream, got, n = small_pool_scheduler(), HandleTable(), StepStream(channel), {}, 0
        met: set[str] = set()
        try:
            while sched.has_unfinished_requests():
                out = sched.schedule()
                msg, order = encode_step(out, table, epoch=EPOCH, step=n)
                if end_with is not None and n == end_at:
                    send(stream, end_with, msg, table, data.draw)
                    return
                # Up to three refused copies before the real step. A kind this run has not met yet goes first,
                # then the kinds take turns, the fields few steps carry (new, resumed and grown requests) first,
                # so a short run still meets every kind.
                added = {table.id_of[h] for h in [*(r.handle for r in msg.new_requests), *msg.resumed]}
                held = {b.block_id for rid, blocks in sched.kv.holders().items() if rid not in added for b in blocks}
                # The steps that carry new or resumed requests are few: they get more copies, or a short run
                # would not meet every kind of their fields.
                most = 5 if msg.new_requests or msg.resumed else 3
                for _ in range(data.draw(st.integers(0, most), label=f"copies of step {n}")):
                    common, rare = mutations_for(msg, table, n, held)
                    turn += 1
                    unmet = [m for m in rare + common if m.__name__ not in met]
                    kinds = unmet or (rare or common if turn % 3 else common)
                    mutate = kinds[turn % len(kinds)]
                    met.add(mutate.__name__)
                    assert send(stream, mutate, msg, table, data.draw)
                if msg.new_requests and data.draw(st.integers(0, 3), label="valid") == 0:
                    # Within the contract's rules: accepted, and the greedy tokens stay the same.
                    msg, _ = odd_but_valid_sampling(msg, table, data.draw)
                    seen["valid"] += 1
                reply = stream.send(msg)
                assert not reply.HasField("resync"), reply.resync.reason
                for d in sched.update_from_output(out, decode_result(reply, order)):
                    got.setdefault(d.req_id, []).extend(d.new_token_ids)
                n += 1
            assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected
        finally:
            stream.close()
            assert proc.poll() is None, log_tail(log_path)
            assert grpc_health(channel) == health_pb2.HealthCheckResponse.SERVING

    fuzz()
    assert seen["kinds"] >= {m.__name__ for m in REFUSED} and seen["refused"] > 100 and seen["valid"], seen
    # A real scheduler on the executor the fuzzing used still gets what the in-process engine computes.
    with scheduler_on(address, tmp_path) as stub:
        assert submit_all(stub, PROMPTS) == expected


def test_a_stranger_writing_into_cached_blocks_cannot_change_the_schedulers_answers(executor, tmp_path):
    """The cache-poisoning attack on the plaintext port: a client reads the scheduler's epoch from Stats, opens
    its own Step stream to the executor and overwrites every KV block, the blocks of a cached prompt included.
    The scheduler's own stream ends at its next step (one stream at a time), and a scheduler that loses its
    link forgets its prefix cache, so the prompt is computed again and answers as before."""
    model, address, channel, proc, log_path = executor
    prompt = list(range(40, 61))                    # 21 tokens: 5 full blocks to cache
    with scheduler_on(address, tmp_path) as stub:
        first, first_lp, cached = submit(stub, prompt)
        again, _, cached_again = submit(stub, prompt)
        assert again == first and cached == 0 and cached_again == 20   # the prefix cache serves the prompt
        before = wait_executor_idle(stub)

        attacker = StepStream(channel)
        junk = [executor_pb2.NewRequest(handle=h, prompt_token_ids=[(11 * h + 3 * i) % VOCAB for i in range(n)],
                                        params=_new_request(0).params, block_ids=blocks)
                for h, n, blocks in ((0, 127, range(1, 33)), (1, 124, range(33, NUM_BLOCKS)))]
        reply = attacker.send(executor_pb2.StepRequest(epoch=before.epoch, step=0, new_requests=junk, handles=[0, 1],
                                                       num_tokens=[127, 124]))
        assert not reply.HasField("resync"), reply.resync.reason            # every block now holds junk
        # The junk matters: the prompt over blocks as a prefix hit, and computed afresh, give other logprobs.
        probe = sampling_pb2.SamplingParams(max_tokens=1, top_p=1.0, top_k=-1, logprobs=5)
        hit = executor_pb2.NewRequest(handle=2, prompt_token_ids=prompt, params=probe, block_ids=range(1, 7),
                                      num_computed_tokens=20)
        fresh = executor_pb2.NewRequest(handle=3, prompt_token_ids=prompt, params=probe, block_ids=range(7, 13))
        # The junk rows go first: while they hold the blocks, no other row may write into them.
        reply = attacker.send(executor_pb2.StepRequest(epoch=before.epoch, step=1, finished=[0, 1],
                                                       new_requests=[hit, fresh], handles=[2, 3], num_tokens=[1, 21]))
        assert not reply.HasField("resync"), reply.resync.reason
        assert list(reply.logprob_values[:6]) != list(reply.logprob_values[6:12])
        attacker.close()

        # The scheduler's step with the prefix hit ends its old stream (ABORTED): it forgets its prefix cache,
        # reconnects and computes the prompt afresh, exactly as the first time.
        after, after_lp, _ = submit(stub, prompt)
        assert after == first and after_lp == pytest.approx(first_lp, abs=1e-5)
        assert stub.Stats(scheduler_pb2.StatsRequest()).executors[0].epoch > before.epoch   # it reconnected
        assert proc.poll() is None


# ---------------------------------------------------------------------------------------------- a scheduler

@contextlib.contextmanager
def scheduler_on(address: str, tmp: Path):
    """A scheduler process driving the executor at `address`, ready, yielding its stub; stopped on exit,
    failing if it exited meanwhile."""
    with Stack([Service("scheduler", flags={
            "--executors": address, "--max-num-batched-tokens": BUDGET, "--max-num-seqs": MAX_SEQS,
            "--metrics-address": "", "--retry-seconds": 0.2})], tmp) as stack, \
            grpc.insecure_channel(stack["scheduler"].address) as channel:
        yield scheduler_pb2_grpc.SchedulerStub(channel)


def submit(stub, prompt) -> tuple[list[int], list[float], int]:
    """A greedy request's tokens, their top-3 logprobs, and how many prompt tokens the prefix cache served."""
    params = sampling_pb2.SamplingParams(max_tokens=TOKENS, temperature=0.0, top_p=1.0, top_k=-1, ignore_eos=True,
                                         logprobs=3)
    tokens, logprobs, cached = [], [], 0
    for out in stub.Submit(scheduler_pb2.SubmitRequest(prompt_token_ids=prompt, params=params), timeout=60):
        tokens += out.token_ids
        logprobs += [v for lp in out.logprobs for v in lp.logprobs]
        cached = max(cached, out.num_cached_tokens)
    return tokens, logprobs, cached


def submit_all(stub, prompts) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return [tokens for tokens, _, _ in pool.map(lambda p: submit(stub, p), prompts)]
