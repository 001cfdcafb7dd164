"""Constrained requests through faults, on the tiny random model with the embedded model's tokenizer: 200
schemas whose every output validates; 16 greedy constrained streams through the kill of one of two executors
and through a scheduler restart, each valid and identical to the run without a fault (the matcher is rebuilt
from the request's tokens wherever it lands); a grammar the executor cannot compile, sent past the gateway,
ends that request alone."""

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

grpc = pytest.importorskip("grpc")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("torch")

from fleet_stack import PROMPTS, Fleet, Streams, deterministic_flags  # noqa: E402
from gateway_stack import tiny_model_with_tokenizer  # noqa: E402
from helpers import wait_until  # noqa: E402
from test_scheduler_restart import Cluster, kill_and_restart  # noqa: E402

from gateway.text.tokenizer import ModelTokenizer  # noqa: E402
from stepwire.internal import sampling_pb2  # noqa: E402
from tools.schema_corpus import generated_schemas  # noqa: E402

pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`

# Long enough for a fault to land mid-output, bounded so that every output ends inside the context.
LONG = {"type": "object", "additionalProperties": False, "required": ["id", "values", "note"], "properties": {
    "id": {"type": "string", "minLength": 10, "maxLength": 14},
    "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 8,
               "maxItems": 8},
    "note": {"type": "string", "minLength": 10, "maxLength": 14}}}
FORMAT = jsonschema.FormatChecker()


def check_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=FORMAT)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("structured"))
    yield c
    c.stop()


def test_200_schemas_every_output_validates(tmp_path):
    """In the in-process engine (the executor's runner and the scheduler's core, as the services run them),
    32 rows at a time: the HTTP path is the same enforcement, tested on the embedded model."""
    from executor_service.engine.runner_config import RunnerConfig
    from launcher.engine import LLMEngine
    from scheduler_service import SchedulerConfig
    from stepwire.contract import SamplingParams

    model = tiny_model_with_tokenizer(tmp_path / "model")
    tok = ModelTokenizer(model)
    engine = LLMEngine(RunnerConfig(str(model), kv_cache_memory=64 << 20, max_num_seqs=32, max_model_len=256),
                       SchedulerConfig(block_size=16, max_model_len=256, max_num_seqs=32, max_num_batched_tokens=512))
    schemas = generated_schemas(200, seed=28)
    outs = engine.generate([tok.encode(f"A {s['title']}:") for s in schemas], [SamplingParams(
        max_tokens=240, temperature=0.0, structured_output=sampling_pb2.StructuredOutput(json_schema=json.dumps(s)))
        for s in schemas])
    for schema, out in zip(schemas, outs, strict=True):
        assert out.finish_reason == "stop", (schema, tok.decode(out.token_ids))   # the grammar ended it
        check_valid(tok.decode(out.token_ids), schema)


def stream(url: str, i: int, progress: list) -> tuple[str, str | None]:
    body = {"model": "model", "prompt": f"Record {i}:", "max_tokens": 200, "stream": True, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": LONG}}}
    chunks, finish = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                chunks.append(event["choices"][0]["text"])
                progress[i] += 1
                finish = event["choices"][0]["finish_reason"] or finish
    return "".join(chunks), finish


def run_16(cluster: Cluster, fault=None) -> list:
    progress = [0] * 16
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream, cluster.urls[0], i, progress) for i in range(16)]
        if fault is not None:
            wait_until(lambda: min(progress) >= 3 or any(f.done() for f in futures), 60, "every stream to start")
            assert not any(f.done() for f in futures), "a stream ended before the fault: make the schema longer"
            fault()
        return [f.result() for f in futures]


def test_16_constrained_streams_through_a_scheduler_restart_stay_valid_and_unchanged(cluster):
    reference = run_16(cluster)
    results = run_16(cluster, kill_and_restart(cluster, signal.SIGKILL))
    for i, ((text, finish), (ref, _)) in enumerate(zip(results, reference, strict=True)):
        assert finish == "stop", f"stream {i} ended with {finish!r}: {text!r}"
        check_valid(text, LONG)
        assert text == ref, f"stream {i} differs from the run without a fault"
    assert cluster.metric(cluster.urls[0], "stepwire:gateway_requests_resumed_total") >= 16


def test_16_constrained_streams_through_the_kill_of_one_of_two_executors_stay_valid_and_unchanged(tmp_path):
    model = tiny_model_with_tokenizer(tmp_path / "model")
    tok = ModelTokenizer(model)
    so = sampling_pb2.StructuredOutput(json_schema=json.dumps(LONG))
    fleet = Fleet(tmp_path, 2, "--executor-wait-seconds", "20", model=model, executor_flags=deterministic_flags())
    try:
        ref = Streams(fleet.stub, PROMPTS, structured_output=so, max_tokens=120)
        ref.join()
        assert ref.errors == [None] * 16
        moved = Streams(fleet.stub, PROMPTS, structured_output=so, max_tokens=120)
        wait_until(moved.started, 30, "every stream's first token", interval=0.005)
        killed = fleet.busy()
        fleet.procs[killed].kill()
        moved.join()
        assert moved.errors == [None] * 16
        assert fleet.stats().num_migrations > 0
        for i, (got, want) in enumerate(zip(moved.tokens, ref.tokens, strict=True)):
            assert got == want, f"stream {i} differs from the run without a fault"
            assert got[-1] in tok_eos(model), f"stream {i} did not end with its grammar"
            check_valid(tok.decode(got), LONG)

        # Past the gateway, straight to the scheduler: a grammar no executor can compile ends that request at
        # once (EOS only), and the others are served as before.
        bad = sampling_pb2.StructuredOutput(regex="a(b")
        refused = Streams(fleet.stub, PROMPTS[:1], structured_output=bad, max_tokens=20)
        fine = Streams(fleet.stub, PROMPTS[:4], structured_output=so, max_tokens=120)
        refused.join()
        fine.join()
        assert refused.errors == [None] and len(refused.tokens[0]) == 1 and refused.tokens[0][0] in tok_eos(model)
        assert fine.tokens == ref.tokens[:4]
        (survivor,) = {"executor-0", "executor-1"} - {killed}
        assert fleet.procs[survivor].poll() is None      # the bad grammar harmed no executor
    finally:
        fleet.stop()


def test_16_constrained_streams_through_the_drain_of_one_of_two_executors_stay_valid_and_unchanged(tmp_path):
    """SIGTERM on an executor mid-stream: with no drain period (the streams of the tiny model may end within
    any period long enough to time), its running requests move to the other executor at once and rebuild
    their matchers there from their tokens."""
    model = tiny_model_with_tokenizer(tmp_path / "model")
    tok = ModelTokenizer(model)
    so = sampling_pb2.StructuredOutput(json_schema=json.dumps(LONG))
    fleet = Fleet(tmp_path, 2, "--executor-wait-seconds", "20", "--drain-seconds", "0", model=model,
                  executor_flags=deterministic_flags())
    try:
        ref = Streams(fleet.stub, PROMPTS, structured_output=so, max_tokens=120)
        ref.join()
        moved = Streams(fleet.stub, PROMPTS, structured_output=so, max_tokens=120)
        wait_until(moved.started, 30, "every stream's first token", interval=0.005)
        fleet.procs[fleet.busy()].send_signal(signal.SIGTERM)
        moved.join()
        assert moved.errors == [None] * 16
        assert fleet.stats().num_migrations > 0
        for i, (got, want) in enumerate(zip(moved.tokens, ref.tokens, strict=True)):
            assert got == want, f"stream {i} differs from the run without a fault"
            check_valid(tok.decode(got), LONG)
    finally:
        fleet.stop()


def tok_eos(model) -> set[int]:
    cfg = json.loads((model / "config.json").read_text())
    eos = cfg.get("eos_token_id", [])
    return set(eos if isinstance(eos, list) else [eos])


def test_a_grammar_too_slow_to_compile_gets_a_400_while_other_requests_go_on(tmp_path):
    from gateway_stack import tiny_stack

    slow = {"structured_outputs": {"choice": [f"option number {i}" for i in range(10000)]}}
    with tiny_stack(tmp_path, ["--structured-compile-seconds", "0.1"]) as stack:
        def post(fields: dict, max_tokens: int = 4):
            return httpx.post(stack.url + "/v1/completions", timeout=60, json={
                "model": "model", "prompt": "Pick:", "max_tokens": max_tokens, "temperature": 0, **fields})

        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(post, {"ignore_eos": True}, 40)
            r = post(slow)
            assert r.status_code == 400, r.text
            assert "structured_outputs: the grammar took longer than 0.1 s to compile" in r.json()["error"]["message"]
            assert plain.result().status_code == 200
        assert post(slow).status_code == 400             # remembered: refused again without compiling
        r = post({"structured_outputs": {"choice": ["left", "right"]}})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in {"left", "right"}
