"""Prefill/decode disaggregation end to end, with the openai client: a prefill executor and a decode executor give
every request the text a fleet of two mixed executors gives, each request prefilled on the first and moved with its
KV to the second after its first token, nothing recomputed; with mTLS, the decode executor pulls over its own
identity."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from gateway_stack import tiny_model_with_tokenizer
from tiny_model import kv_bytes, reference_greedy, write_tiny_llama

from launcher.processes import Service, Stack
from security.dev_certs import make_dev_certs
from stepwire.internal import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.processes

QUESTIONS = [f"Question {i}: what comes after {i * 7}? Explain briefly." for i in range(8)]


def serve(tmp, roles: list[str]):
    model = tiny_model_with_tokenizer(tmp / "model", max_position_embeddings=512)
    executors = [Service("executor", f"executor-{i}", {
        "--model": model, "--block-size": 4, "--kv-cache-memory": kv_bytes(512), "--max-num-seqs": 8,
        "--max-model-len": 256, "--metrics-address": "", "--threads": 1, "--role": role})
        for i, role in enumerate(roles)]
    return Stack([*executors, Service("scheduler", flags={"--metrics-address": ""}),
                  Service("gateway", flags={"--model": model})], tmp)


def ask(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")

    def one(i):
        kw = {"model": "model", "messages": [{"role": "user", "content": QUESTIONS[i]}], "max_tokens": 24,
              "temperature": 0}
        if i % 2:   # half of them streamed: the handoff's pause is invisible in the stream's content
            return "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **kw) if c.choices)
        return client.chat.completions.create(**kw).choices[0].message.content

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return list(pool.map(one, range(len(QUESTIONS))))


def stats(stack) -> scheduler_pb2.StatsResponse:
    with grpc.insecure_channel(stack["scheduler"].address) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).Stats(scheduler_pb2.StatsRequest(), timeout=5)


def test_a_prefill_and_a_decode_executor_answer_what_two_mixed_ones_answer(tmp_path):
    with serve(tmp_path / "mixed", ["mixed", "mixed"]) as stack:
        stack.wait_until(lambda: sum(e.connected for e in stats(stack).executors) == 2, "both executors", 60)
        mixed = ask(stack["gateway"].url)
    with serve(tmp_path / "pd", ["prefill", "decode"]) as stack:
        stack.wait_until(lambda: sum(e.connected for e in stats(stack).executors) == 2, "both executors", 60)
        disaggregated = ask(stack["gateway"].url)
        s = stats(stack)
    assert disaggregated == mixed and all(mixed)
    by_role = {e.role: e for e in s.executors}
    assert set(by_role) == {"prefill", "decode"}
    # Every request came in on the prefill executor and went on, with its KV, on the decode executor.
    assert by_role["prefill"].num_routed == len(QUESTIONS) and by_role["decode"].num_routed == len(QUESTIONS)
    assert s.num_kv_transfers == len(QUESTIONS) and s.num_kv_transfer_failures == 0
    assert sum(e.num_recomputed_tokens for e in s.executors) == 0
    assert s.num_migrations == 0           # a handoff is no migration: nothing was lost or drained


def test_with_mtls_the_decode_executor_pulls_over_its_own_identity(tmp_path):
    certs = make_dev_certs(tmp_path / "certs")
    model = write_tiny_llama(tmp_path / "llama")
    prompt = list(range(5, 30))
    executors = [Service("executor", f"executor-{i}", {
        "--model": model, "--block-size": 4, "--kv-cache-memory": kv_bytes(64), "--max-num-seqs": 8,
        "--max-model-len": 128, "--metrics-address": "", "--threads": 1, "--role": role,
        "--tls-dir": certs / "executor"}) for i, role in enumerate(["prefill", "decode"])]

    def channel(role: str):
        d = certs / role
        creds = grpc.ssl_channel_credentials(*((d / f).read_bytes() for f in ("ca.crt", "tls.key", "tls.crt")))
        return grpc.secure_channel(stack["scheduler"].address, creds,
                                   options=[("grpc.ssl_target_name_override", "stepwire-scheduler")])

    with Stack([*executors, Service("scheduler", flags={"--metrics-address": "", "--max-num-seqs": 8,
                                                        "--max-num-batched-tokens": 16,
                                                        "--tls-dir": certs / "scheduler"})], tmp_path) as stack, \
            channel("operator") as operator, channel("gateway") as gateway:
        stats = lambda: scheduler_pb2_grpc.SchedulerStub(operator).Stats(scheduler_pb2.StatsRequest(), timeout=5)  # noqa: E731
        stack.wait_until(lambda: sum(e.connected for e in stats().executors) == 2, "both executors", 60)
        params = sampling_pb2.SamplingParams(max_tokens=10, temperature=0.0, top_p=1.0, top_k=-1, ignore_eos=True)
        tokens = [t for out in scheduler_pb2_grpc.SchedulerStub(gateway).Submit(
            scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=prompt, params=params), timeout=60)
            for t in out.token_ids]
        s = stats()
    assert tokens == reference_greedy(model, [prompt], 10)[0]
    assert s.num_kv_transfers == 1 and s.num_kv_transfer_failures == 0
