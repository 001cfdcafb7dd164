"""How many steps a link keeps in flight (--max-steps-in-flight, scheduler_service/fleet/step_depth.py), and the
executor's side of it (--run-ahead, --step-pipeline): the settings as parsed, and the choice each link makes from its
own executor's Describe."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_service.fleet.step_depth import steps_in_flight
from scheduler_service.settings import SchedulerSettings
from stepwire.contract.settings import load
from stepwire.internal import executor_pb2


def test_steps_in_flight_is_auto_by_default_a_number_from_one_to_four_or_its_environment_variable(monkeypatch):
    assert load(SchedulerSettings, []).max_steps_in_flight == "auto"
    assert [load(SchedulerSettings, ["--max-steps-in-flight", n]).max_steps_in_flight for n in "1234"] == [1, 2, 3, 4]
    monkeypatch.setenv("STEPWIRE_SCHEDULER_MAX_STEPS_IN_FLIGHT", "3")
    assert load(SchedulerSettings, []).max_steps_in_flight == 3
    assert load(SchedulerSettings, ["--max-steps-in-flight", "auto"]).max_steps_in_flight == "auto"


@pytest.mark.parametrize("argv", [["--max-steps-in-flight", "0"], ["--max-steps-in-flight", "5"],
                                  ["--max-steps-in-flight", "many"],
                                  ["--no-async-scheduling", "--max-steps-in-flight", "2"]])
def test_a_bad_number_of_steps_in_flight_stops_the_scheduler_at_start_naming_it(argv):
    with pytest.raises(SystemExit) as e:
        load(SchedulerSettings, argv)
    assert "max_steps_in_flight" in str(e.value.code) or "--max-steps-in-flight" in str(e.value.code)


def test_auto_keeps_three_steps_for_an_executor_that_runs_ahead_two_for_one_in_lockstep_one_without_async():
    assert steps_in_flight("auto", True, "mixed", runs_ahead=True) == 3
    assert steps_in_flight("auto", True, "decode", runs_ahead=True) == 3
    assert steps_in_flight("auto", True, "mixed", runs_ahead=False) == 2
    assert steps_in_flight("auto", False, "mixed", runs_ahead=True) == 1


def test_a_number_overrides_what_the_executor_says_but_a_prefill_executor_always_gets_one():
    assert steps_in_flight(4, True, "mixed", runs_ahead=False) == 4
    assert steps_in_flight(2, True, "mixed", runs_ahead=True) == 2
    assert steps_in_flight(1, True, "mixed", runs_ahead=True) == 1
    # Its requests leave after their first token, once no step of theirs is in flight.
    assert steps_in_flight("auto", True, "prefill", runs_ahead=True) == 1
    assert steps_in_flight(3, True, "prefill", runs_ahead=False) == 1


def _describe(run_ahead: bool, role: str = "") -> executor_pb2.DescribeResponse:
    return executor_pb2.DescribeResponse(model="m", architecture="LlamaForCausalLM", vocab_size=100,
                                         max_model_len=256, block_size=4, num_blocks=64, dtype="float32",
                                         device="cuda", eos_token_ids=[99], instance_id="x", role=role,
                                         run_ahead=run_ahead)


class _Stub:
    def __init__(self, answer: executor_pb2.DescribeResponse):
        self.answer = answer

    async def Describe(self, request, timeout=None):
        return self.answer


def _connected(settings: SchedulerSettings, *answers):
    """A link connected once per Describe answer (an executor restarted between them); its depth after each."""
    from scheduler_service.fleet.executor_link import ExecutorLink
    from scheduler_service.telemetry.lifecycle import Lifecycles
    from scheduler_service.telemetry.metrics import SchedulerMetrics

    link = ExecutorLink("127.0.0.1:1", settings, lifecycles=Lifecycles(SchedulerMetrics(lambda: []), ""))
    depths = []
    for answer in answers:
        asyncio.run(link._connect(_Stub(answer)))
        depths.append(link.depth)
    return depths


def test_each_link_picks_its_depth_from_its_own_executor_at_every_connect():
    auto = load(SchedulerSettings, [])
    # Executors of one fleet may differ, and a restarted one may run ahead where it did not before.
    assert _connected(auto, _describe(run_ahead=True)) == [3]
    assert _connected(auto, _describe(run_ahead=False)) == [2]
    assert _connected(auto, _describe(run_ahead=False), _describe(run_ahead=True)) == [2, 3]
    assert _connected(auto, _describe(run_ahead=True, role="prefill")) == [1]
    assert _connected(load(SchedulerSettings, ["--no-async-scheduling"]), _describe(run_ahead=True)) == [1]
    assert _connected(load(SchedulerSettings, ["--max-steps-in-flight", "4"]), _describe(run_ahead=False)) == [4]


def test_the_executor_runs_ahead_on_cuda_by_default_and_true_or_false_force_it(monkeypatch):
    pytest.importorskip("torch")
    from executor_service.settings import ExecutorSettings

    monkeypatch.delenv("STEPWIRE_EXECUTOR_RUN_AHEAD", raising=False)
    monkeypatch.delenv("STEPWIRE_EXECUTOR_DEVICE", raising=False)
    assert load(ExecutorSettings, []).run_ahead == "auto"
    assert load(ExecutorSettings, ["--device", "cuda"]).runs_ahead()
    assert load(ExecutorSettings, ["--device", "cuda:1"]).runs_ahead()
    assert not load(ExecutorSettings, ["--device", "cpu"]).runs_ahead()
    assert load(ExecutorSettings, ["--device", "cpu", "--run-ahead", "true"]).runs_ahead()
    assert not load(ExecutorSettings, ["--device", "cuda", "--run-ahead", "false"]).runs_ahead()
    monkeypatch.setenv("STEPWIRE_EXECUTOR_RUN_AHEAD", "on")       # bench/gpu.py's spelling
    assert load(ExecutorSettings, ["--device", "cpu"]).runs_ahead()
    with pytest.raises(SystemExit) as e:
        load(ExecutorSettings, ["--run-ahead", "sometimes"])
    assert "run_ahead" in str(e.value.code)


def test_the_step_pipeline_holds_every_step_the_scheduler_keeps_in_flight_unless_it_is_set():
    pytest.importorskip("torch")
    from executor_service.settings import ExecutorSettings

    auto = load(ExecutorSettings, [])
    assert auto.step_pipeline == "auto"
    assert (auto.pipeline(runs_ahead=True), auto.pipeline(runs_ahead=False)) == (3, 2)
    assert steps_in_flight("auto", True, "mixed", runs_ahead=True) <= auto.pipeline(runs_ahead=True)
    set_to = load(ExecutorSettings, ["--step-pipeline", "1"])
    assert (set_to.pipeline(runs_ahead=True), set_to.pipeline(runs_ahead=False)) == (1, 1)
    with pytest.raises(SystemExit) as e:
        load(ExecutorSettings, ["--step-pipeline", "5"])
    assert "step_pipeline" in str(e.value.code)
