"""A scheduler and its executors as processes on loopback, and streams read on threads: the fleet tests'
harness."""

import threading
import time
from pathlib import Path

import grpc
from tiny_model import executor_dtype, kv_bytes, write_tiny_llama
from tiny_model import reference_greedy as tiny_reference

from launcher.processes import Service, Stack, flag_dict, free_ports
from stepwire.internal import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc

BUDGET = 16
TOKENS = 60           # long enough that a fault lands mid-stream on the tiny model
PROMPTS = [[5 + i, 6, 7, 8 + i] for i in range(16)]


def deterministic_flags() -> tuple[str, ...]:
    """Executor flags for a test that asserts a request's tokens are unchanged through a fault (a kill, a drain,
    a move, a restart). The request is recomputed in a batch of another shape: in bfloat16 that rounds otherwise
    and can flip a near tie, so there the executors run in deterministic mode, which gives a request the same
    bits in any batch and keeps the assertion exact. In float32 a recompute moves a logit by about 1e-6, less
    than any near tie of the tests' tiny models, and the executors run as they ship."""
    return () if executor_dtype() == "float32" else ("--deterministic",)


def reference_greedy(model: Path, prompts: list[list[int]], max_tokens: int = 10,
                     budget: int = BUDGET) -> list[list[int]]:
    """Greedy tokens from the in-process engine, configured as Fleet configures its executors and on one thread as
    they are, in the mode deterministic_flags chooses for them: in bfloat16 only deterministic kernels give the
    bits that deterministic executors give."""
    return tiny_reference(model, prompts, max_tokens, budget, one_thread=True,
                          deterministic=bool(deterministic_flags()))


class Fleet:
    """Executors and a scheduler as processes. By default the scheduler gets the executors as a static list;
    `discovery` flags replace that, and `started` says how many executors run from the start."""

    def __init__(self, tmp: Path, num_executors: int, *scheduler_flags: str, executor_flags=(), discovery=(),
                 started: int | None = None, same_port: bool = False, port: int | None = None,
                 flags_of: dict[int, tuple[str, ...]] | None = None, env: dict | None = None,
                 model: Path | None = None):
        self.tmp, self.model = tmp, model or write_tiny_llama(tmp / "llama")
        flags_of = flags_of or {}     # executor index -> flags for that executor only
        same = {}
        if same_port:   # the same port on 127.0.0.1, .2, .3...: one executor per pod IP, as a headless Service has
            port = port or free_ports(1)[0]
            same = {i: {"--address": f"127.0.0.{i + 1}:{port}"} for i in range(num_executors)}
        started = num_executors if started is None else started
        executors = [Service("executor", f"executor-{i}", {
            "--model": self.model, **same.get(i, {}), "--block-size": 4, "--kv-cache-memory": kv_bytes(64),
            "--max-num-seqs": 8, "--max-model-len": 128, "--metrics-address": "", "--threads": 1,
            **flag_dict(executor_flags), **flag_dict(flags_of.get(i, ()))}, env=env or {}, autostart=i < started)
            for i in range(num_executors)]
        scheduler = Service("scheduler", flags={
            **flag_dict(discovery), "--max-num-batched-tokens": BUDGET, "--max-num-seqs": 8, "--metrics-address": "",
            "--retry-seconds": 0.2, **flag_dict(scheduler_flags)}, env=env or {})
        self.stack = Stack([*executors, scheduler], tmp)
        self.procs = self.stack.procs
        self.addresses = [e.address for e in executors]
        self.sc_addr = scheduler.address
        self.channel = grpc.insecure_channel(self.sc_addr)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.wait_connected(self.addresses[:started])

    def wait_connected(self, addresses) -> None:
        self.stack.wait_until(lambda: {e.address for e in self.stats().executors if e.connected} == set(addresses),
                              f"exactly {sorted(addresses)} to be connected", 60)

    def steps(self) -> dict[str, int]:
        return {e.address: e.num_steps for e in self.stats().executors}

    def busy(self) -> str:
        """The name of an executor running requests now, for a fault to hit: which one gets them is routing's
        choice (load, and prefixes cached by an earlier run), not the test's."""
        names = {address: f"executor-{i}" for i, address in enumerate(self.addresses)}
        running = sorted((-e.num_running, e.address) for e in self.stats().executors if e.num_running > 0)
        assert running, "no executor runs a request"
        return names[running[0][1]]

    def start_executor(self, i: int) -> None:
        self.stack.start(f"executor-{i}")

    def logs(self) -> list[Path]:
        return self.stack.logs()

    def stats(self) -> scheduler_pb2.StatsResponse:
        return self.stub.Stats(scheduler_pb2.StatsRequest())

    def stop(self) -> None:
        self.channel.close()
        self.stack.close(check=False)


class Streams:
    """Requests submitted on the scheduler's port, each read to its end on its own thread."""

    def __init__(self, stub, prompts, **params):
        self.tokens = [[] for _ in prompts]
        self.errors: list = [None] * len(prompts)
        self.ended_at = [0.0] * len(prompts)
        self.threads = [threading.Thread(target=self._read, args=(stub, i, p, params), daemon=True)
                        for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _read(self, stub, i, prompt, params):
        kw = {"max_tokens": TOKENS, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True} | params
        if isinstance(kw.get("seed"), list):
            kw["seed"] = kw["seed"][i]
        try:
            for out in stub.Submit(scheduler_pb2.SubmitRequest(
                    request_id=f"r{i}-{id(self)}", prompt_token_ids=prompt, params=sampling_pb2.SamplingParams(**kw))):
                self.tokens[i] += out.token_ids
        except grpc.RpcError as e:
            self.errors[i] = e
        self.ended_at[i] = time.monotonic()

    def started(self) -> bool:
        return all(self.tokens)

    def join(self, seconds: float = 60) -> None:
        for t in self.threads:
            t.join(seconds)
        assert not any(t.is_alive() for t in self.threads), "a stream never ended"
