"""Requests a client may resume, at the scheduler (resumed_streams.py), on real processes: a resumable request
outlives the Session that carried it (its gateway died) or a detach (its client's connection broke), and another
Session that names it with the same tenant gets every output token so far and then the rest, the same tokens
as a run that was never cut. Another tenant, an unknown id and an expired one get NOT_FOUND alike; an expired
request is aborted and its blocks freed."""

import queue
import time
import uuid

import httpx
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("torch")

from tiny_model import kv_bytes, write_tiny_llama  # noqa: E402

from launcher.processes import Service, Stack  # noqa: E402
from stepwire.internal import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc  # noqa: E402

pytestmark = pytest.mark.processes

PROMPT = [5, 17, 33, 8, 91, 4]
TOKENS = 120
BUFFER = 8
METRICS: dict[str, str] = {}
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]


class SessionCall:
    """One Session stream, as a gateway holds it: requests go up a queue, outputs are read on demand."""

    def __init__(self, stub):
        self.up: queue.Queue = queue.Queue()
        self.call = stub.Session(iter(self.up.get, None))
        self.outputs = (o for message in self.call for o in message.outputs)

    def submit(self, rid: str, tenant: str = "", resumable: bool = True, context: bytes = b"") -> None:
        params = sampling_pb2.SamplingParams(max_tokens=TOKENS, temperature=0.0, top_p=1.0, ignore_eos=True)
        self.up.put(scheduler_pb2.SessionRequest(submit=scheduler_pb2.SubmitRequest(
            request_id=rid, prompt_token_ids=PROMPT, params=params, tenant=tenant, resumable=resumable,
            resume_context=context)))

    def resume(self, rid: str, tenant: str = "") -> None:
        self.up.put(scheduler_pb2.SessionRequest(resume=scheduler_pb2.ResumeRequest(request_id=rid, tenant=tenant)))

    def detach(self, rid: str) -> None:
        self.up.put(scheduler_pb2.SessionRequest(detach=scheduler_pb2.AbortRequest(request_ids=[rid])))

    def read(self, rid: str, until_tokens: int | None = None) -> tuple[list, list[int], str]:
        """`rid`'s outputs until it finishes (or has `until_tokens` tokens): (outputs, tokens, finish)."""
        outs, tokens = [], []
        for o in self.outputs:
            if o.request_id != rid:
                continue
            outs.append(o)
            if o.HasField("error"):
                return outs, tokens, "error"
            tokens += o.token_ids
            if o.finish_reason or (until_tokens is not None and len(tokens) >= until_tokens):
                return outs, tokens, o.finish_reason
        raise AssertionError("the session ended")

    def close(self) -> None:
        self.call.cancel()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    model = write_tiny_llama(tmp / "llama")
    executor = Service("executor", flags={"--model": model, "--block-size": 4, "--kv-cache-memory": kv_bytes(256),
                                          "--max-num-seqs": 8, "--max-model-len": 256, "--metrics-address": "",
                                          "--threads": 1})
    # A buffer of 8 unread tokens: every kept request here is parked, and a resume must bring it back.
    with Stack([executor, Service("scheduler", flags={"--resume-grace-seconds": 2,
                                                      "--resume-buffer-tokens": BUFFER})],
               tmp) as s:
        METRICS["url"] = f"http://{s['scheduler'].flags['--metrics-address']}/metrics"
        channel = grpc.insecure_channel(s["scheduler"].address)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        ref = SessionCall(stub)
        ref.submit("reference", resumable=False)
        _, tokens, finish = ref.read("reference")
        ref.close()
        assert finish == "length" and len(tokens) == TOKENS
        yield stub, tokens
        channel.close()


def requests_held(stub) -> int:
    return stub.Stats(scheduler_pb2.StatsRequest()).num_requests


def test_a_request_whose_session_died_is_resumed_by_another_session_with_every_token_once(stack):
    stub, want = stack
    rid = f"r-{uuid.uuid4().hex}"
    first = SessionCall(stub)
    first.submit(rid, tenant="team-a", context=b'{"how": "chat"}')
    _, seen, _ = first.read(rid, until_tokens=3)
    first.close()                                     # the gateway died mid-stream
    second = SessionCall(stub)
    second.resume(rid, tenant="team-b")               # another tenant's key: as if there were no such request
    outs, _, end = second.read(rid)
    assert end == "error" and outs[0].error.code == NOT_FOUND
    second.resume(rid, tenant="team-a")
    outs, tokens, finish = second.read(rid)
    assert outs[0].replay and outs[0].resume_context == b'{"how": "chat"}'
    assert tokens[:len(seen)] == seen and tokens == want and finish == "length"
    assert not any(o.replay for o in outs[1:])
    # Ended on the second session: its last deltas might have died with that gateway, so it is kept all the same
    # (for the grace period), and a resume gets every token and the end at once.
    third = SessionCall(stub)
    third.resume(rid, tenant="team-a")
    outs, tokens, finish = third.read(rid)
    assert len(outs) == 1 and outs[0].replay and tokens == want and finish == "length"
    second.close()
    third.close()


def test_a_detached_request_keeps_running_and_is_resumed_while_its_session_lives_on(stack):
    stub, want = stack
    rid = f"r-{uuid.uuid4().hex}"
    gateway = SessionCall(stub)
    gateway.submit(rid, tenant="team-a")
    _, seen, _ = gateway.read(rid, until_tokens=2)
    gateway.detach(rid)                               # the client's connection broke; the gateway is fine
    gateway.resume(rid, tenant="team-a")              # the client came back, to the same gateway
    outs, tokens, finish = gateway.read(rid)
    replay = next(i for i, o in enumerate(outs) if o.replay)
    resumed = [t for o in outs[replay:] for t in o.token_ids]
    assert resumed == want and finish == "length" and resumed[:len(seen)] == seen
    gateway.close()


def test_a_request_nobody_resumes_in_the_grace_period_is_aborted_and_its_id_then_unknown(stack):
    stub, _ = stack
    rid = f"r-{uuid.uuid4().hex}"
    first = SessionCall(stub)
    first.submit(rid, tenant="team-a")
    first.read(rid, until_tokens=1)
    first.close()
    time.sleep(3)                                     # --resume-grace-seconds 2
    deadline = time.monotonic() + 10
    while requests_held(stub) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert requests_held(stub) == 0
    late = SessionCall(stub)
    late.resume(rid, tenant="team-a")
    outs, _, end = late.read(rid)
    assert end == "error" and outs[0].error.code == NOT_FOUND and "no resumable request" in outs[0].error.message
    late.close()


def test_a_request_not_submitted_as_resumable_ends_with_its_session(stack):
    stub, _ = stack
    rid = f"r-{uuid.uuid4().hex}"
    first = SessionCall(stub)
    first.submit(rid, resumable=False)
    first.read(rid, until_tokens=1)
    first.close()
    late = SessionCall(stub)
    late.resume(rid)
    outs, _, end = late.read(rid)
    assert end == "error" and outs[0].error.code == NOT_FOUND
    late.close()


def test_a_resume_that_outruns_the_first_gateways_detach_takes_the_request_from_its_session(stack):
    """The client came back through another gateway before the first one told the scheduler it had gone."""
    stub, want = stack
    rid = f"r-{uuid.uuid4().hex}"
    first = SessionCall(stub)
    first.submit(rid, tenant="team-a")
    first.read(rid, until_tokens=2)
    second = SessionCall(stub)
    second.resume(rid, tenant="team-b")              # not another tenant's, even while it is live
    outs, _, end = second.read(rid)
    assert end == "error" and outs[0].error.code == NOT_FOUND
    second.resume(rid, tenant="team-a")
    first.detach(rid)                                 # late: the request is the second session's now
    first.up.put(scheduler_pb2.SessionRequest(abort=scheduler_pb2.AbortRequest(request_ids=[rid])))
    outs, tokens, finish = second.read(rid)
    assert outs[0].replay and tokens == want and finish == "length"
    first.close()
    second.close()


def test_a_resume_through_the_same_gateway_before_it_let_go_replays_and_the_session_carries_on(stack):
    """Its client came back through the same gateway before that gateway had detached it."""
    stub, want = stack
    rid = f"r-{uuid.uuid4().hex}"
    gateway = SessionCall(stub)
    gateway.submit(rid, tenant="team-a")
    _, seen, _ = gateway.read(rid, until_tokens=2)
    gateway.resume(rid, tenant="team-a")
    outs, _, _ = gateway.read(rid)
    replay = next(i for i, o in enumerate(outs) if o.replay)
    resumed = [t for o in outs[replay:] for t in o.token_ids]
    assert resumed == want and resumed[:len(seen)] == seen and outs[-1].finish_reason == "length"
    gateway.close()


def test_a_kept_request_stops_once_its_unread_tokens_fill_the_buffer_and_a_resume_runs_it_to_its_end(stack):
    stub, want = stack
    rid = f"r-{uuid.uuid4().hex}"
    gateway = SessionCall(stub)
    gateway.submit(rid, tenant="team-a")
    gateway.read(rid, until_tokens=2)
    gateway.detach(rid)
    time.sleep(1.5)          # unparked, the tiny model would make all of its 120 tokens in a fraction of this
    assert requests_held(stub) == 1
    assert parked_now() == 1
    gateway.resume(rid, tenant="team-a")
    outs, _, finish = gateway.read(rid)
    replay = next(o for o in outs if o.replay)
    # What it had when detached (the two read, and what was on the way) plus the buffer, plus the steps that
    # were in flight when it was parked (at most 4).
    assert len(replay.token_ids) <= 2 + 16 + BUFFER + 4, len(replay.token_ids)
    resumed = [t for o in outs[outs.index(replay):] for t in o.token_ids]
    assert resumed == want and finish == "length"
    assert parked_now() == 0
    gateway.close()


def parked_now() -> float:
    text = httpx.get(METRICS["url"]).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("stepwire:num_requests_parked{"))
