"""The in-process engine: one scheduler core and one model runner in one process, stepping in lockstep.

It is the reference the gRPC split must match token for token, and the fastest single-process baseline.
Each step crosses the same encoding the services use (handles, the step diff, the packed result) without
the network, so the two can only differ in the hop itself. It composes both services' cores, so it lives
here rather than in either service.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from executor_service.batch.step import StepResult
from executor_service.batch.wire import decode_step, encode_result
from executor_service.engine import run_ahead
from executor_service.engine.runner import ModelRunner
from executor_service.engine.runner_config import RunnerConfig
from scheduler_service import Request, RequestDelta, Scheduler, SchedulerConfig
from scheduler_service.core.config import step_defaults
from scheduler_service.fleet.wire import HandleTable, decode_result, encode_step
from stepwire.contract import SamplingParams


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0


class LLMEngine:
    def __init__(self, runner_config: RunnerConfig, scheduler_config: SchedulerConfig | None = None,
                 run_ahead: bool | None = None):
        """`run_ahead` (default: on a GPU) queues each plain step on the device before the last one's tokens
        reach the host, and schedules it meanwhile (executor_service/engine/run_ahead.py); tokens are the same."""
        self.runner = ModelRunner(runner_config)
        facts = self.runner.describe()
        self.run_ahead = facts["device"].startswith("cuda") if run_ahead is None else run_ahead
        self._ahead = None     # (scheduler output, handle order, Ahead) of the step in flight
        if scheduler_config is None:
            # The scheduler service's defaults for this device (a CPU chunks long prompts), so the engine and
            # the split stack schedule alike.
            auto = step_defaults(facts["device"])
            scheduler_config = SchedulerConfig(max_num_seqs=runner_config.max_num_seqs,
                                               max_model_len=facts["max_model_len"],
                                               block_size=facts["block_size"],
                                               max_num_batched_tokens=min(auto.max_num_batched_tokens,
                                                                          facts["max_num_batched_tokens"]),
                                               long_prefill_token_threshold=auto.long_prefill_token_threshold)
        if scheduler_config.block_size != facts["block_size"]:
            raise ValueError(f"scheduler block_size {scheduler_config.block_size} != executor's "
                             f"{facts['block_size']}")
        self.scheduler = Scheduler(scheduler_config, facts["num_blocks"])
        self.scheduler.adapters.configure(facts.get("max_loras", 0), facts.get("max_cpu_loras", 0))
        self.adapters: dict[str, tuple[str, str]] = {}   # LoRA: name -> (key, path), checked by the runner
        self.eos_token_ids = tuple(facts["eos_token_ids"])
        self.handles = HandleTable()
        self._ids = itertools.count()

    def load_adapter(self, name: str, path: str) -> None:
        """Register a LoRA adapter under `name` (read and checked now: AdapterError if it cannot be served)."""
        if self.runner.lora is None:
            raise ValueError("the runner serves no adapters (max_loras=0)")
        self.runner.lora.read(name, path)
        self.adapters[name] = (f"{name}@{next(self._ids)}", path)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, adapter: str = "", tenant: str = "",
                    weight: float = 1.0) -> str:
        """Queue a prompt; `adapter` names a loaded LoRA adapter (empty: the base model); `tenant` and its
        `weight` set its share of the steps against other tenants' requests."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.scheduler.add_request(Request(rid, list(prompt_token_ids), params or SamplingParams(),
                                           eos_token_ids=self.eos_token_ids, priority=priority,
                                           lora=self.adapters[adapter] if adapter else None, tenant=tenant,
                                           weight=weight))
        return rid

    def abort(self, request_ids) -> None:
        self.scheduler.abort_requests(request_ids)

    def step(self) -> list[RequestDelta]:
        """Schedule and run one step. Running ahead, the step is launched and the one before it finished:
        the deltas are that one's."""
        out = self.scheduler.schedule()
        if out.is_empty and not out.finished_req_ids and not out.preempted_req_ids:
            return self._finish_ahead()     # what is in flight may be all that is left
        msg, order = encode_step(out, self.handles, epoch=1, step=0)
        step = decode_step(msg)
        if self.run_ahead and run_ahead.plain(self.runner, step):
            launched = run_ahead.launch(self.runner, step, self._ahead[2] if self._ahead else None)
            deltas = self._finish_ahead()
            if isinstance(launched, StepResult):    # nothing sampled: answered at once
                return deltas + self._update(out, order, launched, len(step.handles))
            self._ahead = (out, order, launched)
            return deltas
        deltas = self._finish_ahead()   # a step that needs the tokens on the host waits for them
        if step.lora_loads or step.lora_rows:
            # As the executor service does, before the step is applied.
            self.runner.lora.check_step(step, self.runner.batch)
            self.runner.lora.fetch(step)
        return deltas + self._update(out, order, self.runner.execute(step, msg), len(step.handles))

    def _update(self, out, order, result: StepResult, n: int) -> list[RequestDelta]:
        reply = encode_result(result, n, 1, 0)
        return self.scheduler.update_from_output(out, decode_result(reply, order))

    def _finish_ahead(self) -> list[RequestDelta]:
        if self._ahead is None:
            return []
        (out, order, ahead), self._ahead = self._ahead, None
        return self._update(out, order, ahead.result(self.runner.batch), len(order))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 adapters: list[str] | None = None) -> list[Completion]:
        """Run every prompt to completion (each under its adapter, where given); results in the order of
        `prompts`."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        done: dict[str, Completion] = {}
        order = []
        for prompt, p, a in zip(prompts, plist, adapters or [""] * len(prompts), strict=True):
            rid = self.add_request(prompt, p, adapter=a)
            done[rid] = Completion(rid, list(prompt))
            order.append(rid)
        while self.has_unfinished() or self._ahead is not None:   # nothing left in flight for the next caller
            for d in self.step():
                c = done.get(d.req_id)
                if c is not None:
                    c.token_ids += d.new_token_ids
                    c.finish_reason = d.finish_reason
                    c.num_cached_tokens = d.num_cached_tokens
        return [done[r] for r in order]

    def stream(self, prompt: list[int], params: SamplingParams | None = None) -> Iterator[RequestDelta]:
        """Yield this request's deltas as they come; other queued requests keep running alongside."""
        rid = self.add_request(prompt, params)
        try:
            while True:
                for d in self.step():
                    if d.req_id == rid:
                        yield d
                        if d.finish_reason is not None:
                            return
        finally:
            if rid in self.scheduler.requests:
                self.abort([rid])
