"""A request's scheduler span and metrics, driven by the real scheduler core in process, through a
preemption; spans go to the OpenTelemetry SDK's in-memory exporter."""

import pytest

pytest.importorskip("opentelemetry.sdk")

from helpers import fake_runner, make_scheduler, req  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from observability import tracing  # noqa: E402
from scheduler_service.telemetry.lifecycle import Lifecycles  # noqa: E402
from scheduler_service.telemetry.metrics import SchedulerMetrics  # noqa: E402

TRACE = "0af7651916cd43dd8448eb211c80319c"


@pytest.fixture
def exported(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    return exporter


def sample(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels or None) or 0


def test_a_preempted_request_has_preempted_and_rescheduled_events_and_metrics_count_it_once(exported):
    # Four usable blocks of 16: two 16-token prompts fit, but both cannot grow past 32 tokens.
    sched = make_scheduler(num_blocks=5, block_size=16)
    metrics = SchedulerMetrics(lambda: [])
    lives = Lifecycles(metrics, "m")
    for i, rid in enumerate(("A", "B")):
        r = req(rid, 16, max_tokens=30, first=100 * i, ignore_eos=True)
        sched.add_request(r)
        lives.admitted(r, f"00-{TRACE}-00f067aa0ba902b{i}-01", "ex")
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        lives.scheduled(out)
        lives.delivered(sched.update_from_output(out, fake_runner(sched, out)))
    assert not sched.has_unfinished_requests() and sched.num_preemptions >= 1
    spans = {s.attributes["stepwire.request.id"]: s for s in exported.get_finished_spans()}
    assert set(spans) == {"A", "B"}
    b = spans["B"]
    assert f"{b.context.trace_id:032x}" == TRACE and f"{b.parent.span_id:016x}" == "00f067aa0ba902b1"
    events = [e.name for e in b.events]
    assert events[:3] == ["queued", "scheduled", "first_token"] and events[-1] == "finished"
    assert events.count("preempted") == sched.num_preemptions
    assert events.count("scheduled") == 1 + events.count("preempted")      # rescheduled after each one
    assert b.attributes["stepwire.num_preemptions"] == events.count("preempted")
    assert b.attributes["gen_ai.usage.output_tokens"] == 30 and b.attributes["gen_ai.usage.input_tokens"] == 16
    assert [e.name for e in spans["A"].events] == ["queued", "scheduled", "first_token", "finished"]
    # Recomputing B's KV after its preemption is not counted as a new request or new prompt tokens.
    assert sample(metrics, "stepwire:request_success_total", finished_reason="length") == 2
    assert sample(metrics, "stepwire:prompt_tokens_total") == 32
    assert sample(metrics, "stepwire:generation_tokens_total") == 60
    assert sample(metrics, "stepwire:time_to_first_token_seconds_count") == 2
    assert sample(metrics, "stepwire:request_queue_time_seconds_count") == 2
    assert sample(metrics, "stepwire:inter_token_latency_seconds_count") == 58
    assert not lives.lives


def test_an_aborted_request_ends_its_span_with_abort(exported):
    sched = make_scheduler(num_blocks=50)
    metrics = SchedulerMetrics(lambda: [])
    lives = Lifecycles(metrics, "m")
    r = req("X", 20, max_tokens=50)
    sched.add_request(r)
    lives.admitted(r, "", "ex")
    out = sched.schedule()
    lives.scheduled(out)
    lives.delivered(sched.update_from_output(out, fake_runner(sched, out)))
    for a in sched.abort_requests(["X"]):
        lives.finished(a.request_id, "abort")
    (span,) = exported.get_finished_spans()
    assert span.parent is None and span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert sample(metrics, "stepwire:request_success_total", finished_reason="abort") == 1
    assert sample(metrics, "stepwire:e2e_request_latency_seconds_count") == 1
