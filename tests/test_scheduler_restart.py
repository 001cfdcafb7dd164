"""A scheduler restart that clients do not notice: the services as real processes on loopback ports.

16 streams, over HTTP and gRPC, greedy and seeded, run once without a fault for reference; then the scheduler
is killed (SIGKILL, or SIGTERM) mid-stream and a new one started on the same port. Every stream must finish
with exactly the reference's text and tokens, no error, nothing repeated: the gateways resubmit each request
from the tokens they already delivered. With no scheduler coming back, every stream ends with the documented
error within the deadline, and the gateway's journal is empty afterwards.
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from fleet_stack import deterministic_flags
from gateway_stack import tiny_model_with_tokenizer
from helpers import wait_until
from tiny_model import kv_bytes

from gateway.generation.backend import SCHEDULER_GONE
from launcher.processes import Service, Stack, flag_dict
from stepwire.v1 import generation_pb2 as g
from stepwire.v1 import generation_pb2_grpc

TOKENS = 96
PROMPTS = [f"Request {i}: tell me about the number {i * 7}." for i in range(16)]


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


class Cluster:
    """One executor, a scheduler that can be killed and started again on its port, and gateways. The executor
    is deterministic where its dtype needs it for a resumed request to keep its tokens (deterministic_flags)."""

    def __init__(self, tmp: Path, gateways: int = 1, wait_seconds: float = 60, executor_flags: tuple = ()):
        self.model = tiny_model_with_tokenizer(tmp / "model")
        self.stack = Stack([
            Service("executor", flags={"--model": self.model, "--block-size": 4, "--kv-cache-memory": kv_bytes(512),
                                       "--max-num-seqs": 16, "--max-model-len": 256, "--metrics-address": "",
                                       **flag_dict(deterministic_flags()), **flag_dict(executor_flags)}),
            Service("scheduler", flags={"--metrics-address": ""}),
            *(Service("gateway", f"gateway{i}", {"--model": self.model, "--scheduler-wait-seconds": wait_seconds})
              for i in range(gateways))], tmp)
        gateways = [s for s in self.stack.services.values() if s.kind == "gateway"]
        self.urls, self.grpcs = [g.url for g in gateways], [g.address for g in gateways]

    def metric(self, url: str, name: str) -> float:
        for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in {url}/metrics")

    def stop(self) -> None:
        self.stack.close()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


def seeded(i: int) -> bool:
    return i % 2 == 1


def http_stream(url: str, i: int, progress: list) -> tuple[str, list[str], str | None]:
    """One streaming completion: its text, every chunk's text, its finish reason (or the error's message)."""
    body = {"model": "model", "prompt": PROMPTS[i], "max_tokens": TOKENS, "stream": True, "ignore_eos": True,
            "temperature": 1.0 if seeded(i) else 0.0, **({"seed": 1000 + i} if seeded(i) else {})}
    chunks, finish = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "".join(chunks), chunks, "error: " + event["error"]["message"]
            choice = event["choices"][0]
            chunks.append(choice["text"])
            progress[i] += 1
            finish = choice["finish_reason"] or finish
    return "".join(chunks), chunks, finish


def grpc_stream(address: str, i: int, progress: list) -> tuple[str, list[int], str | None]:
    params = g.SamplingParameters(max_tokens=TOKENS, ignore_eos=True, temperature=1.0 if seeded(i) else 0.0)
    if seeded(i):
        params.seed = 1000 + i
    text, tokens = [], []
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            finish = None
            for msg in stub.GenerateStream(g.GenerateRequest(text=PROMPTS[i], params=params), timeout=120):
                text.append(msg.text)
                tokens += msg.token_ids
                progress[i] += 1
                finish = g.FinishReason.Name(msg.finish_reason) if msg.finish_reason else finish
        except grpc.RpcError as e:
            return "".join(text), tokens, f"error: {e.details()}"
    return "".join(text), tokens, finish


def run_all(cluster: Cluster, fault=None, wait_for: int = 3) -> list:
    """The 16 streams at once, spread over the gateways: even ones over HTTP, odd ones over gRPC. `fault` runs
    once every stream has had `wait_for` chunks."""
    progress = [0] * len(PROMPTS)
    n = len(cluster.urls)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(http_stream, cluster.urls[i % n], i, progress) if i % 4 < 2
                   else pool.submit(grpc_stream, cluster.grpcs[i % n], i, progress) for i in range(len(PROMPTS))]
        if fault is not None:
            wait_until(lambda: min(progress) >= wait_for or any(f.done() for f in futures), 60,
                       "every stream to have started")
            assert not any(f.done() for f in futures), "a stream ended before the fault: make them longer"
            fault()
        return [f.result() for f in futures]


def kill_and_restart(cluster: Cluster, sig: int, pause: float = 2.0):
    return lambda: cluster.stack.restart("scheduler", sig, pause=pause)


def check_same(results: list, reference: list) -> None:
    for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
        assert got[2] in ("length", "FINISH_REASON_LENGTH"), f"stream {i} ended with {got[2]!r}"
        assert got[0] == ref[0], f"stream {i}'s text differs from the run without a fault"
        if i % 4 >= 2:
            assert got[1] == ref[1] and len(got[1]) == TOKENS, f"stream {i}'s tokens differ or repeat"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_a_scheduler_killed_mid_stream_and_restarted_is_invisible_to_clients(cluster, sig):
    reference = run_all(cluster)
    assert all(r[2] in ("length", "FINISH_REASON_LENGTH") for r in reference)
    url = cluster.urls[0]
    results = run_all(cluster, kill_and_restart(cluster, sig))
    check_same(results, reference)
    assert cluster.metric(url, "stepwire:gateway_requests_resumed_total") >= 8   # its half of the 16
    assert cluster.metric(url, "stepwire:gateway_resume_wait_seconds_count") >= 8
    assert cluster.metric(url, "stepwire:gateway_journal_requests") == 0
    if sig == signal.SIGTERM:
        log = cluster.stack.log("scheduler").read_text()          # the first scheduler's, and the second's
        assert "SIGTERM: telling 1 gateway sessions" in log, log[-2000:]


def test_in_bfloat16_deterministic_mode_a_killed_scheduler_changes_no_token(tmp_path):
    """bfloat16 is where a resumed request, recomputed in another batch, could take another continuation:
    deterministic mode keeps every stream identical to the run without a fault."""
    c = Cluster(tmp_path, executor_flags=("--deterministic", "--dtype", "bfloat16"))
    try:
        reference = run_all(c)
        check_same(run_all(c, kill_and_restart(c, signal.SIGKILL)), reference)
        assert c.metric(c.urls[0], "stepwire:gateway_requests_resumed_total") >= 8
    finally:
        c.stop()


def test_two_gateways_each_resume_their_own_requests_across_a_restart(tmp_path):
    c = Cluster(tmp_path, gateways=2)
    try:
        reference = run_all(c)
        results = run_all(c, kill_and_restart(c, signal.SIGKILL, pause=1.0))
        check_same(results, reference)
        for url in c.urls:
            assert c.metric(url, "stepwire:gateway_requests_resumed_total") >= 4
            assert c.metric(url, "stepwire:gateway_journal_requests") == 0
    finally:
        c.stop()


def streams_end_with_the_deadline_error(c: Cluster, wait: float, stop) -> float:
    """Run the 16 streams and `stop` the scheduler mid-way with no successor: every stream must end with the
    documented error and the journal must be empty. Returns the seconds from the stop to the last end."""
    stopped = {}

    def fault():
        stop()
        stopped["at"] = time.monotonic()

    results = run_all(c, fault)
    took = time.monotonic() - stopped["at"]
    assert all(r[2] == "error: " + SCHEDULER_GONE.format(wait) for r in results), [r[2] for r in results]
    assert c.metric(c.urls[0], "stepwire:gateway_journal_requests") == 0
    return took


def test_with_no_scheduler_back_every_stream_ends_with_the_documented_error_within_the_deadline(tmp_path):
    wait = 3.0
    c = Cluster(tmp_path, wait_seconds=wait)
    try:
        took = streams_end_with_the_deadline_error(c, wait, lambda: c.stack.kill("scheduler"))
        assert took <= wait + 1.0 + 1.0     # the deadline, a second, and the clients' own exits
        c.stack.start("scheduler")                           # and the stack serves again afterwards
        c.stack.wait_ready("gateway0")
        assert http_stream(c.urls[0], 0, [0])[2] == "length"
    finally:
        c.stop()


def test_a_frozen_scheduler_is_found_by_keepalive_and_its_streams_end_by_the_deadline(tmp_path):
    # SIGSTOP: the connection stays open and says nothing. Keepalive (5 s, then 5 s for the answer) must
    # break the session; without it these streams would hang for ever.
    wait = 2.0
    c = Cluster(tmp_path, wait_seconds=wait)
    try:
        took = streams_end_with_the_deadline_error(c, wait, lambda: c.stack.pause("scheduler"))
        assert took <= 5 + 5 + wait + 5, f"the frozen scheduler was noticed after {took:.1f}s"
    finally:
        c.stack.restart("scheduler", signal.SIGKILL)     # a live one, so that stop() finds every process running
        c.stop()
