"""Step-size defaults by executor device: a CPU executor gets a small step budget and a long-prefill cap, so one
long prompt cannot freeze the other streams for a whole 8,000-token step; CUDA keeps vLLM's figures; flags win.

No timings here: what a CPU step costs is measured by bench/long_prompt.py."""

import asyncio
from types import SimpleNamespace

import pytest
from helpers import req, step

from scheduler_service import Scheduler, SchedulerConfig
from scheduler_service.core.config import CPU_STEP_DEFAULTS, GPU_STEP_DEFAULTS, step_defaults
from scheduler_service.fleet.executor_link import ExecutorLink
from scheduler_service.settings import SchedulerSettings
from stepwire.contract.settings import load
from stepwire.internal import executor_pb2

CPU = (CPU_STEP_DEFAULTS.max_num_batched_tokens, CPU_STEP_DEFAULTS.long_prefill_token_threshold)
GPU = (8192, 0)


def step_knobs(cfg: SchedulerConfig) -> tuple[int, int]:
    return cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold


def test_the_defaults_themselves():
    assert (GPU_STEP_DEFAULTS.max_num_batched_tokens, GPU_STEP_DEFAULTS.long_prefill_token_threshold) == GPU
    budget, threshold = CPU
    assert 0 < threshold <= budget < GPU[0]
    # The core's own defaults stay vLLM's: the traces in bench/scheduler_step.py compare against vLLM with them.
    assert step_knobs(SchedulerConfig()) == GPU
    for device in ("cpu", "CPU", "cpu:0"):
        assert step_defaults(device) == CPU_STEP_DEFAULTS
    for device in ("cuda", "cuda:1", "", "mps"):
        assert step_defaults(device) == GPU_STEP_DEFAULTS


@pytest.mark.parametrize(("device", "expected"), [("cpu", CPU), ("cuda", GPU), ("cuda:0", GPU)])
def test_unset_flags_take_the_executors_device_defaults(device, expected):
    s = load(SchedulerSettings, [])
    assert (s.max_num_batched_tokens, s.long_prefill_token_threshold) == (None, None)
    assert step_knobs(s.core_config(16, 8192, device)) == expected


def test_a_flag_or_variable_always_wins_and_the_other_knob_stays_automatic(monkeypatch):
    s = load(SchedulerSettings, ["--max-num-batched-tokens", "8192", "--long-prefill-token-threshold", "0"])
    assert step_knobs(s.core_config(16, 8192, "cpu")) == (8192, 0)           # the old behaviour, on purpose
    s = load(SchedulerSettings, ["--long-prefill-token-threshold", "100"])
    assert step_knobs(s.core_config(16, 8192, "cpu")) == (CPU[0], 100)
    assert step_knobs(s.core_config(16, 8192, "cuda")) == (8192, 100)
    monkeypatch.setenv("STEPWIRE_SCHEDULER_MAX_NUM_BATCHED_TOKENS", "300")
    s = load(SchedulerSettings, [])
    assert step_knobs(s.core_config(16, 8192, "cpu")) == (300, CPU[1])
    assert step_knobs(s.core_config(16, 8192, "cuda")) == (300, 0)


def test_without_chunked_prefill_the_automatic_budget_holds_a_whole_prompt():
    s = load(SchedulerSettings, ["--no-enable-chunked-prefill"])
    assert s.core_config(16, 8192, "cpu").max_num_batched_tokens == 8192
    assert s.core_config(16, 2048, "cpu").max_num_batched_tokens == max(CPU[0], 2048)
    # An explicit budget too small for the context is still refused, naming the problem.
    s = load(SchedulerSettings, ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "512"])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        s.core_config(16, 8192, "cpu")


def test_the_budget_never_exceeds_what_the_executor_computes_in_one_step():
    """The executor refuses a bigger step, which costs a resync of every request: its cap (from Describe) bounds
    the budget, a flag's included; 0 (an executor that does not say) bounds nothing."""
    s = load(SchedulerSettings, ["--max-num-batched-tokens", "16384"])
    assert s.core_config(16, 8192, "cuda", 0, 8192).max_num_batched_tokens == 8192
    assert s.core_config(16, 8192, "cuda").max_num_batched_tokens == 16384
    s = load(SchedulerSettings, [])
    assert s.core_config(16, 8192, "cpu", 0, 300).max_num_batched_tokens == 300
    assert s.core_config(16, 8192, "cpu", 0, 8192).max_num_batched_tokens == CPU[0]


class _Describes:
    def __init__(self, device: str, max_num_batched_tokens: int = 0):
        self.device = device
        self.max_num_batched_tokens = max_num_batched_tokens

    async def Describe(self, request, timeout=None):  # noqa: N802 (the gRPC method's name)
        return executor_pb2.DescribeResponse(model="/m/SmolLM2", max_model_len=8192, block_size=16, num_blocks=600,
                                             device=self.device, eos_token_ids=[2],
                                             max_num_batched_tokens=self.max_num_batched_tokens)


def test_each_executor_link_builds_its_core_from_its_own_describe():
    """A mixed fleet: each link's core gets the defaults of the device its executor reports."""
    settings = load(SchedulerSettings, [])

    async def connect(device):
        link = ExecutorLink(f"{device}:1", settings, lifecycles=SimpleNamespace(model=""))
        await link._connect(_Describes(device))
        return link.core.config

    cpu, gpu = asyncio.run(connect("cpu")), asyncio.run(connect("cuda"))
    assert (step_knobs(cpu), step_knobs(gpu)) == (CPU, GPU)
    assert (cpu.block_size, cpu.max_model_len) == (16, 8192)


def test_an_executor_link_caps_its_budget_by_what_its_executor_describes():
    async def connect():
        link = ExecutorLink("cuda:1", load(SchedulerSettings, []), lifecycles=SimpleNamespace(model=""))
        await link._connect(_Describes("cuda", max_num_batched_tokens=2048))
        return link.core.config

    assert asyncio.run(connect()).max_num_batched_tokens == 2048


def test_a_long_prompt_beside_four_decodes_is_cut_into_capped_chunks_and_the_decodes_run_every_step():
    cfg = load(SchedulerSettings, []).core_config(16, 8192, "cpu")
    sched = Scheduler(cfg, num_blocks=1000)
    streams = [f"s{i}" for i in range(4)]
    for i, rid in enumerate(streams):
        sched.add_request(req(rid, 20, max_tokens=1000, first=100_000 + 100 * i, ignore_eos=True))
    step(sched)                                      # their prompts; from here on they decode
    sched.add_request(req("long", 8000, max_tokens=1))
    chunks = []
    while "long" in sched.requests:
        out, deltas = step(sched)
        assert all(out.num_scheduled_tokens[rid] == 1 for rid in streams), out.num_scheduled_tokens
        assert {d.req_id for d in deltas} >= set(streams)     # each stream got a token this step
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        chunks.append(out.num_scheduled_tokens["long"])
    threshold = min(cfg.long_prefill_token_threshold, cfg.max_num_batched_tokens - 4)
    assert sum(chunks) == 8000 and max(chunks) <= threshold
    assert len(chunks) == -(-8000 // threshold)


def test_with_the_old_defaults_the_same_prompt_takes_one_step():
    """What the CPU defaults fix: 8192/0 schedule the whole 8,000-token prompt in one step."""
    cfg = load(SchedulerSettings, []).core_config(16, 8192, "cuda")
    sched = Scheduler(cfg, num_blocks=1000)
    for i in range(4):
        sched.add_request(req(f"s{i}", 20, max_tokens=1000, first=100_000 + 100 * i, ignore_eos=True))
    step(sched)
    sched.add_request(req("long", 8000, max_tokens=1))
    out, _ = step(sched)
    assert out.num_scheduled_tokens["long"] == 8000 and "long" not in sched.requests


@pytest.mark.parametrize("amx, avx512_bf16, expected", [(True, False, "bfloat16"), (False, True, "bfloat16"),
                                                        (False, False, "float32")])
def test_cpu_dtype_is_bfloat16_only_where_the_cpu_multiplies_it_natively(monkeypatch, amx, avx512_bf16, expected):
    import torch

    from executor_service.engine.runner_config import default_dtype
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert default_dtype("cpu") == expected
    assert default_dtype("cuda") == default_dtype("cuda:1") == "bfloat16"


def test_amx_that_the_kernel_refuses_to_enable_does_not_count(monkeypatch):
    import torch

    from executor_service.engine.runner_config import default_dtype
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert default_dtype("cpu") == "float32"


def test_this_machines_default_dtype_is_what_torch_says_it_supports(tmp_path, monkeypatch):
    import torch
    from tiny_model import write_tiny_llama

    from executor_service.engine.runner import ModelRunner
    from executor_service.engine.runner_config import RunnerConfig
    native = (torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx()) or torch.cpu._is_avx512_bf16_supported()
    monkeypatch.delenv("STEPWIRE_EXECUTOR_DTYPE", raising=False)     # the machine's own default, not the suite's
    runner = ModelRunner(RunnerConfig(write_tiny_llama(tmp_path), kv_cache_memory=1 << 20))
    assert runner.describe()["dtype"] == ("bfloat16" if native else "float32")
    assert ModelRunner(RunnerConfig(write_tiny_llama(tmp_path / "b"), dtype="float32",
                                    kv_cache_memory=1 << 20)).describe()["dtype"] == "float32"


def test_the_in_process_engine_takes_the_same_device_defaults_as_the_scheduler_service(tmp_path):
    from tiny_model import kv_bytes, write_tiny_llama

    from executor_service.engine.runner_config import RunnerConfig
    from launcher.engine import LLMEngine
    engine = LLMEngine(RunnerConfig(str(write_tiny_llama(tmp_path)), block_size=4, kv_cache_memory=kv_bytes(64),
                                    max_model_len=128))
    assert step_knobs(engine.scheduler.config) == CPU
