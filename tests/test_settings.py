"""Each service's settings: flags over STEPWIRE_<SERVICE>_* variables over defaults, checked at start."""

from dataclasses import fields

import pytest

from gateway.settings import GatewaySettings
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.settings import SchedulerSettings
from stepwire.contract.settings import load


def test_environment_variables_set_a_service_and_flags_override_them(monkeypatch):
    monkeypatch.setenv("STEPWIRE_SCHEDULER_EXECUTORS", "10.0.0.7:50061, 10.0.0.8:50061")
    monkeypatch.setenv("STEPWIRE_SCHEDULER_MAX_NUM_SEQS", "64")
    monkeypatch.setenv("STEPWIRE_SCHEDULER_ENABLE_PREFIX_CACHING", "false")
    s = load(SchedulerSettings, [])
    assert (s.executors, s.max_num_seqs, s.enable_prefix_caching) == (["10.0.0.7:50061", "10.0.0.8:50061"], 64, False)
    s = load(SchedulerSettings, ["--max-num-seqs", "8", "--executors", "a:1", "--enable-prefix-caching"])
    assert (s.executors, s.max_num_seqs, s.enable_prefix_caching) == (["a:1"], 8, True)


def test_one_services_variables_do_not_leak_into_another(monkeypatch):
    monkeypatch.setenv("STEPWIRE_SCHEDULER_ADDRESS", "0.0.0.0:1")
    monkeypatch.setenv("STEPWIRE_GATEWAY_SCHEDULER", "sched:50051")
    assert load(GatewaySettings, []).scheduler == "sched:50051"
    assert load(SchedulerSettings, []).address == "0.0.0.0:1"


@pytest.mark.parametrize("argv, field", [
    (["--max-num-seqs", "0"], "max_num_seqs"), (["--policy", "lifo"], "policy"),
    (["--max-num-batched-tokens", "many"], "max_num_batched_tokens"), (["--retry-seconds", "nan"], "retry_seconds"),
])
def test_a_bad_setting_stops_the_process_at_start_naming_it(argv, field):
    with pytest.raises(SystemExit) as e:
        load(SchedulerSettings, argv)
    assert field in str(e.value.code)


def test_every_scheduler_config_knob_is_a_setting_and_reaches_the_core_by_name():
    names = {f.name for f in fields(SchedulerConfig)} - {"block_size"}   # block_size comes from the executor
    assert names <= set(SchedulerSettings.model_fields)
    s = load(SchedulerSettings, ["--max-num-seqs", "3", "--long-prefill-token-threshold", "5", "--policy", "priority",
                                 "--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096"])
    cfg = s.core_config(block_size=32, executor_max_model_len=2048)
    assert (cfg.max_num_seqs, cfg.long_prefill_token_threshold, cfg.policy, cfg.enable_chunked_prefill,
            cfg.block_size, cfg.max_model_len) == (3, 5, "priority", False, 32, 2048)


def test_max_model_len_is_capped_by_what_the_executor_holds():
    assert load(SchedulerSettings, ["--max-model-len", "512"]).core_config(16, 2048).max_model_len == 512
    assert load(SchedulerSettings, ["--max-model-len", "8192"]).core_config(16, 2048).max_model_len == 2048


def test_every_runner_config_knob_is_an_executor_setting():
    pytest.importorskip("torch")
    from executor_service.engine.runner_config import RunnerConfig
    from executor_service.settings import ExecutorSettings

    s = load(ExecutorSettings, ["--model", "/m", "--kv-cache-memory", "1000", "--dtype", "bfloat16"])
    cfg = s.runner_config()
    assert (cfg.model, cfg.kv_cache_memory, cfg.dtype) == ("/m", 1000, "bfloat16")
    assert {f.name for f in fields(RunnerConfig)} <= set(ExecutorSettings.model_fields)
