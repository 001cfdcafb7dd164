"""An OpenAPI-driven fuzz of the HTTP API: schemathesis reads the gateway's own /openapi.json and generates
requests for every operation, ones that fit the schema and ones that break it, and a real stack answers them.
No request may get a 5xx or go unanswered, streams included, and every refusal has OpenAI's error shape."""

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("torch")

from gateway_stack import tiny_stack  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

EXAMPLES = 20     # per operation and mode: bounds the test's time
HANG = 60         # seconds: a request not answered by then hangs (a stream of the tiny model takes well under 1 s)
NAME = "model"    # what the stack serves; a random name would turn nearly every valid request into a 400
OPERATIONS = {"GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
              "POST /detokenize", "GET /health", "GET /metrics", "POST /v1/load_lora_adapter",
              "POST /v1/unload_lora_adapter", "GET /v1/streams/{stream_id}", "POST /v1/responses",
              "POST /v1/messages"}


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with tiny_stack(tmp_path_factory.mktemp("fuzz")) as s:
        yield s, schemathesis.openapi.from_url(s.url + "/openapi.json", timeout=HANG)


def with_served_model(case, served: bool):
    # Half the generated bodies name the served model, so valid requests reach generation and tokenizing.
    if served and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = NAME
    return case


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_no_generated_request_gets_a_5xx_or_hangs(api, mode):
    stack, schema = api
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} == OPERATIONS
    statuses = []
    for op in operations:
        if mode == GenerationMode.NEGATIVE and not op.body:
            continue   # nothing to break in an operation without parameters (/v1/models, /health, /metrics)
        cases = st.tuples(op.as_strategy(generation_mode=mode), st.booleans())

        # No shrinking: a failure is reported as found, and a hang cannot be retried for minutes.
        @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(cases)
        def call(drawn):
            case = with_served_model(*drawn)
            r = case.call(base_url=stack.url, timeout=HANG)
            assert r.status_code < 500, f"{case.method} {case.path} {case.body!r}: {r.status_code} {r.text[:500]}"
            if r.status_code >= 400:
                assert r.json()["error"]["message"], r.text
            statuses.append((case.path, r.status_code))

        call()
    # The fuzz reached the handlers: requests that fit the schema were generated from, others refused.
    if mode == GenerationMode.POSITIVE:
        assert ("/v1/chat/completions", 200) in statuses and ("/tokenize", 200) in statuses
    else:
        assert 400 in {status for _, status in statuses}
