"""Running one step ahead (executor_service/engine/run_ahead.py): the in-process engine queues a step before the last
one's tokens reach the host, and every request still gets the tokens, logprobs and finish of lockstep running,
through chunked prefill, preemption, aborts, prefix-cache hits and seeded sampling. On the CPU the device is the
host, so what this checks is the bookkeeping: the holes, their filling from the step in flight, and the tokens
written back to requests that moved, were parked or ended meanwhile."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_model import chunked_and_cached_prompts, kv_bytes, write_tiny_llama

from executor_service.engine import run_ahead
from executor_service.engine.runner_config import RunnerConfig
from launcher.engine import LLMEngine
from scheduler_service import SchedulerConfig
from stepwire.contract import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("ahead") / "llama")


def engine(model, run_ahead: bool, blocks: int = 64, budget: int = 24, **runner) -> LLMEngine:
    return LLMEngine(RunnerConfig(str(model), device=DEVICE, dtype="float32", block_size=4,
                                  kv_cache_memory=kv_bytes(blocks), max_num_seqs=8, max_model_len=128, **runner),
                     SchedulerConfig(block_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=budget),
                     run_ahead=run_ahead)


def workload(seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 97, int(rng.integers(3, 30))).tolist() for _ in range(7)]
    prompts.append(prompts[0][:12] + [5, 6, 7])          # shares a prefix: a cache hit once the first is in
    params = [SamplingParams(max_tokens=int(rng.integers(4, 20)), ignore_eos=True,
                             temperature=0.0 if i % 3 else 0.9, seed=None if i % 3 else 100 + i,
                             logprobs=2 if i % 2 else None)
              for i in range(len(prompts))]
    return prompts, params


def run(e: LLMEngine, prompts, params):
    out = e.generate(prompts, params)
    return [(c.token_ids, c.finish_reason) for c in out]


def logprobs_of(e: LLMEngine, prompts, params) -> dict[str, list]:
    got: dict[str, list] = {}
    rids = [e.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while e.has_unfinished():
        for d in e.step():
            got.setdefault(d.req_id, []).extend(d.logprobs or [])
    return [got.get(r, []) for r in rids]


def test_running_ahead_gives_lockstep_s_tokens_logprobs_and_finishes(model):
    prompts, params = workload()
    lock = engine(model, run_ahead=False)
    ahead = engine(model, run_ahead=True)
    launched = []
    real = run_ahead.launch
    run_ahead.launch = lambda *a: launched.append(1) or real(*a)
    try:
        assert run(ahead, prompts, params) == run(lock, prompts, params)
        assert logprobs_of(ahead, prompts, params) == logprobs_of(lock, prompts, params)
    finally:
        run_ahead.launch = real
    assert len(launched) > 20, "the engine did not run its steps ahead"
    assert not ahead.has_unfinished()
    assert ahead.scheduler.kv.num_free_blocks == lock.scheduler.kv.num_free_blocks   # every block came back


def test_a_request_preempted_while_its_token_is_in_flight_keeps_it(model):
    # 14 blocks of 4 tokens for 8 requests of up to 50: the scheduler preempts while steps are in flight, and a
    # parked request's hole is filled when the step that sampled it finishes.
    prompts, params = workload(1)
    lock, ahead = engine(model, False, blocks=14), engine(model, True, blocks=14)
    assert run(ahead, prompts, params) == run(lock, prompts, params)
    assert ahead.scheduler.num_preemptions > 0, "the workload did not preempt"


def test_a_step_that_only_preempts_still_reaches_the_executor(model):
    # A step may preempt and schedule nothing (the request that needed the blocks was the victim); the executor
    # must still park the victims, or their resumption names requests it never parked.
    prompts = chunked_and_cached_prompts()
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = {}
    for ahead in (False, True):
        e = LLMEngine(RunnerConfig(str(model), device=DEVICE, dtype="float32", block_size=4,
                                   kv_cache_memory=kv_bytes(24), max_num_seqs=32, max_model_len=256),
                      SchedulerConfig(block_size=4, max_model_len=256, max_num_seqs=32, max_num_batched_tokens=16,
                                      long_prefill_token_threshold=8), run_ahead=ahead)
        out: dict[str, list[int]] = {}
        e.add_request(prompts[0], greedy, "p0")
        for _ in range(3):                      # p0 alone first, then the others arrive
            for d in e.step():
                out.setdefault(d.req_id, []).extend(d.new_token_ids)
        for i, p in enumerate(prompts[1:], start=1):
            e.add_request(p, greedy, f"p{i}")
        while e.has_unfinished() or e._ahead is not None:
            for d in e.step():
                out.setdefault(d.req_id, []).extend(d.new_token_ids)
        assert e.scheduler.num_preemptions > 0
        got[ahead] = out
    assert got[True] == got[False]


def test_an_abort_while_a_step_is_in_flight_drops_its_token_and_frees_its_blocks(model):
    prompts, params = workload(2)
    e = engine(model, True)
    free = e.scheduler.kv.num_free_blocks
    rids = [e.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for _ in range(4):
        e.step()
    assert e._ahead is not None
    e.abort(rids[:4])
    while e.has_unfinished():
        e.step()
    e.step()
    assert e._ahead is None
    assert e.scheduler.kv.num_free_blocks == free


def test_a_handle_freed_while_its_token_is_in_flight_gets_no_token_of_its_old_request(model):
    # Aborted with a step in flight, the request's handle goes to the next one added; the old request's token,
    # when it comes back, must not land in the new one's tokens (at its prompt's end, where its hole would be).
    e = engine(model, True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    old = e.add_request([5, 6, 7, 8, 9], params)
    for _ in range(3):
        e.step()
    assert e._ahead is not None
    at = int(e._ahead[2].positions[0])
    e.abort([old])
    prompt = list(range(10, 10 + at))
    new = e.add_request(prompt, params)
    tokens = []
    while e.has_unfinished() or e._ahead is not None:
        tokens += [t for d in e.step() if d.req_id == new for t in d.new_token_ids]
    assert tokens == engine(model, False).generate([prompt], params)[0].token_ids


def test_requests_that_stop_on_eos_get_lockstep_s_tokens(tmp_path):
    # A stop the scheduler learns a step late: the step in flight sampled a token for a request that ended, and
    # its handle may already be a new request's (four rows for forty requests).
    probe = write_tiny_llama(tmp_path / "probe")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, int(rng.integers(30, 90))).tolist() for _ in range(40)]
    ignore = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    counts = np.bincount([t for c in small(probe, False).generate(prompts, ignore) for t in c.token_ids])
    eos = int(np.argsort(counts)[-3])      # a token greedy decoding gives often, but not always
    model = write_tiny_llama(tmp_path / "eos", eos_token_id=eos)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    lock = small(model, False).generate(prompts, params)
    assert sum(c.finish_reason == "stop" for c in lock) >= 5, "too few requests stopped on EOS to test anything"
    ahead = small(model, True).generate(prompts, params)
    assert [(c.token_ids, c.finish_reason) for c in ahead] == [(c.token_ids, c.finish_reason) for c in lock]


def small(model, run_ahead: bool) -> LLMEngine:
    return LLMEngine(RunnerConfig(str(model), device=DEVICE, dtype="float32", block_size=4,
                                  kv_cache_memory=kv_bytes(256), max_num_seqs=4, max_model_len=128),
                     SchedulerConfig(block_size=4, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64),
                     run_ahead=run_ahead)


def test_a_step_that_resumes_a_constrained_request_does_not_run_ahead(model):
    from executor_service.batch.input_batch import RequestState
    from executor_service.batch.step import Step

    e = engine(model, True)
    parked = RequestState(7, None)
    e.runner.batch.parked[7] = parked
    resume = Step(handles=[7], num_tokens=[1], total_tokens=1, resumed=[(7, 4, [1])])
    assert run_ahead.plain(e.runner, resume)
    parked.grammar = object()
    assert not run_ahead.plain(e.runner, resume)


def test_a_step_naming_adapters_does_not_run_ahead_so_an_executor_without_them_refuses_it(model):
    from executor_service.batch.step import Step

    e = engine(model, True)
    assert e.runner.lora is None
    assert run_ahead.plain(e.runner, Step(handles=[], num_tokens=[], total_tokens=0))
    assert not run_ahead.plain(e.runner, Step(handles=[], num_tokens=[], total_tokens=0, lora_rows=[(0, 1)]))
    assert not run_ahead.plain(e.runner, Step(handles=[], num_tokens=[], total_tokens=0,
                                               lora_loads=[(0, "a@1", "/x")]))


def test_holes_never_reach_the_model(model):
    # Eager, so that every step goes through the model's forward (a replayed CUDA graph does not); the graphs'
    # input buffer is filled by the same function, and the token tests above cover it on a GPU.
    e = engine(model, True, cuda_graphs=False)
    seen = []
    real = e.runner.model.forward

    def forward(ids, *a, **kw):
        seen.append(ids.clone())
        return real(ids, *a, **kw)
    e.runner.model.forward = forward
    prompts, params = workload(3)
    e.generate(prompts, params)
    assert len(seen) > 10 and all(bool((ids >= 0).all()) for ids in seen)


@pytest.mark.processes
def test_an_executor_running_ahead_serves_what_a_lockstep_one_serves_through_preemptions(tmp_path):
    """Real processes: the scheduler's async scheduling sends the next step while one runs, and an executor with
    --run-ahead true leaves a step in flight while it launches that one. Eight concurrent completions, greedy and
    seeded, in a KV cache too small for all of them at once, get the same tokens from both executors. Both are
    deterministic (batch-invariant): otherwise how a step's batch is made up, which timing decides, changes near
    ties, and two runs of one lockstep executor already differ now and then."""
    import asyncio

    import httpx
    from gateway_stack import tiny_stack

    rng = np.random.default_rng(5)
    bodies = [{"prompt": rng.integers(300, 20000, int(rng.integers(8, 40))).tolist(), "max_tokens": 40,
               "ignore_eos": True, "temperature": 0.0 if i % 2 else 0.8, **({} if i % 2 else {"seed": 70 + i}),
               "logprobs": 1 if i % 3 == 0 else None} for i in range(8)]

    async def serve(url: str) -> list:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def one(body):
                r = await client.post("/v1/completions", json={"model": "model", **body})
                r.raise_for_status()
                choice = r.json()["choices"][0]
                return choice["text"], choice["finish_reason"], choice.get("logprobs")
            return await asyncio.gather(*(one(b) for b in bodies))

    got, counters = {}, {}
    for mode in ("off", "on"):
        with tiny_stack(tmp_path / mode, executor_flags={"--run-ahead": "true" if mode == "on" else "false",
                                                         "--deterministic": True},
                        kv_blocks=48) as s:
            got[mode] = asyncio.run(serve(s.url))
            counters[mode] = {name: metric(url, name) for url, name in (
                (s.executor_metrics, "stepwire:executor_steps_ran_ahead_total"),
                (s.scheduler_metrics, "stepwire:num_preemptions_total"))}
    assert got["on"] == got["off"]
    assert all(text for text, _, _ in got["on"])
    assert counters["off"]["stepwire:executor_steps_ran_ahead_total"] == 0
    assert counters["on"]["stepwire:executor_steps_ran_ahead_total"] > 10, counters
    assert counters["on"]["stepwire:num_preemptions_total"] > 0, "the workload did not preempt"


def metric(url: str, name: str) -> float:
    import httpx
    lines = [ln for ln in httpx.get(url, timeout=10).text.splitlines() if ln.startswith(name)]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)
