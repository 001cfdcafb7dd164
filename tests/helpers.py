"""Small drivers shared by the scheduler tests: a fake runner and ways to put a scheduler in a given state."""

from __future__ import annotations

from scheduler_service import Request, RequestStatus, RunnerOutput, Scheduler, SchedulerConfig
from stepwire.contract import SamplingParams

OUT = 7  # the token the fake model samples


def make_scheduler(num_blocks: int = 1000, **cfg) -> Scheduler:
    cfg.setdefault("max_model_len", 20000)
    cfg.setdefault("max_num_batched_tokens", 8192)
    return Scheduler(SchedulerConfig(**cfg), num_blocks=num_blocks)


def req(rid: str, n: int, max_tokens: int = 4, first: int = 0, **kw) -> Request:
    """A request whose prompt is `n` distinct tokens starting at `first` (distinct so blocks never collide)."""
    sp_keys = {"stop_token_ids", "ignore_eos", "min_tokens", "temperature", "seed"}
    sp = SamplingParams(max_tokens=max_tokens, **{k: v for k, v in kw.items() if k in sp_keys})
    rest = {k: v for k, v in kw.items() if k not in sp_keys}
    return Request(rid, list(range(first, first + n)), sp, **rest)


def fake_runner(sched: Scheduler, out, token: int = OUT) -> RunnerOutput:
    """What a model runner would return: a token for each request whose scheduled tokens reach its end."""
    ids = list(out.num_scheduled_tokens)
    return RunnerOutput(ids, [[token] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                              else [] for r in ids])


def step(sched: Scheduler, token: int = OUT):
    """One engine step with the fake runner: returns (scheduler output, deltas)."""
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_runner(sched, out, token))


def place_running(sched: Scheduler, request: Request, num_computed: int, num_output: int = 0) -> Request:
    """Put a request straight into the running queue as if it had computed `num_computed` tokens and
    generated `num_output` tokens, holding exactly the blocks that needs (through the KV manager)."""
    sched.add_request(request)
    sched.waiting.remove_all([request])
    request.all_token_ids.extend([OUT] * num_output)
    request.update_block_hashes(sched.config.block_size)
    assert sched.kv.allocate_slots(request, num_computed) is not None
    request.num_computed_tokens = num_computed
    request.status = RequestStatus.RUNNING
    sched.running.append(request)
    return request


def free_port() -> int:
    """A loopback port nothing listens on right now (for services the tests start as processes)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct such ports (the launcher's, which gives services theirs)."""
    from launcher.processes import free_ports

    return free_ports(n)


def free_port_runs(count: int, length: int) -> list[int]:
    """`count` first ports of runs of `length` consecutive free loopback ports (the launcher's)."""
    from launcher.processes import free_port_runs

    return free_port_runs(count, length)


def log_tail(path, lines: int = 40) -> str:
    """The last `lines` lines of a service's log file, for failure messages."""
    from pathlib import Path

    path = Path(path)
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"--- {path.name}: unreadable ({e})"
    tail = text.splitlines()[-lines:]
    return f"--- last {len(tail)} lines of {path}:\n" + "\n".join(tail)


def stop_processes(procs, timeout: float = 15) -> None:
    """SIGTERM to every process first, then wait for each: a service stops only after its grace period when a
    peer still holds a stream to it, so stopping them one after another costs a grace period per process."""
    procs = list(procs.values()) if isinstance(procs, dict) else list(procs)
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=timeout)


def wait_until(predicate, timeout: float, what, *, procs=None, logs=(), interval: float = 0.1):
    """Poll `predicate` until it returns something truthy, and return that.

    Fails with `what` (a string, or a callable giving one, e.g. to show the last state seen) when `timeout`
    seconds pass, or as soon as one of `procs` (a name -> process dict, or one process) has exited; the failure
    message ends with the tail of each file in `logs` (a path or several).
    """
    import time
    from pathlib import Path

    if procs is not None and not isinstance(procs, dict):     # one process: a Popen, or a forked Stack member
        procs = {"process": procs}
    procs = procs or {}
    logs = [logs] if isinstance(logs, str | Path) else list(logs)

    def fail(why: str):
        text = what() if callable(what) else what
        raise AssertionError("\n".join([f"{why} while waiting for {text}", *(log_tail(p) for p in logs)]))

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        if dead:
            fail(f"exited ({', '.join(f'{n}: code {rc}' for n, rc in dead.items())})")
        if time.monotonic() >= deadline:
            fail(f"timed out after {timeout:g}s")
        time.sleep(interval)


def wait_http_ready(url: str, procs: dict, seconds: float = 120, logs=()) -> None:
    """Poll the gateway's /health until it answers 200; fail early if one of the processes died, showing the
    tail of each of `logs`."""
    import httpx

    def ready():
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, seconds, f"{url}/health to answer 200", procs=procs, logs=logs, interval=0.3)


def grpc_health(channel, timeout: float = 1) -> int | None:
    """The standard gRPC health service's status on `channel`, or None when it does not answer."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status
    except grpc.RpcError:
        return None


def wait_executor_idle(stub, seconds: float = 10):
    """Poll the scheduler's Stats until its first executor runs nothing, queues nothing and has every block
    free; returns that executor's stats."""
    from stepwire.internal import scheduler_pb2

    last = []

    def idle():
        e = stub.Stats(scheduler_pb2.StatsRequest()).executors[0]
        last[:] = [e]
        return e.num_free_blocks == e.num_total_blocks and e.num_running == 0 and e.num_waiting == 0

    wait_until(idle, seconds, lambda: f"the executor to be idle; last stats: {last[0] if last else None}")
    return last[0]


def record_logits(engine) -> list:
    """Wrap the engine's runner so every sampled row's logits are kept as (request id, position, logits)."""
    seen = []
    forward = engine.runner.forward

    def spy(inputs):
        logits = forward(inputs)
        for k, i in enumerate(inputs.sample_mask.nonzero()[0]):
            rid = engine.handles.id_of[inputs.handles[i]]
            seen.append((rid, int(inputs.seq_lens[i]) - 1, logits[k].clone()))
        return logits

    engine.runner.forward = spy
    return seen


def command_words(pid: int) -> list[str]:
    """A process's command line as words: NUL-separated as exec'd, or one string where a forked service set its
    title to the command that would have started it (launcher/forked.py)."""
    from pathlib import Path
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split()


def runs_service(pid: int, kind: str) -> bool:
    """Is `pid` a service of `kind` (`-m <its module>`), started anew or forked? (Not the fork server, whose
    command names every module.)"""
    from launcher.processes import MODULE
    words = command_words(pid)
    return any(a == "-m" and b == MODULE[kind] for a, b in zip(words, words[1:], strict=False))


def bf16_linear_unsupported() -> str | None:
    """Why this machine's torch cannot run a bfloat16 linear layer, or None when it can. It is probed the way
    the executor runs one (its oneDNN path, which needs more than one row) and through `F.linear`: oneDNN has
    no bfloat16 inner product on CPUs without native bfloat16 instructions (no avx512_bf16 or AMX)."""
    import torch

    from executor_service.kernels.linear import linear

    x, w = torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16)
    try:
        linear(x, w)
        torch.nn.functional.linear(x, w)
    except RuntimeError as e:
        return f"this CPU's torch cannot run a bfloat16 linear layer: {str(e).splitlines()[0][:160]}"
    return None


def skip_unless_torch_runs(dtype: str) -> None:
    """Skip the calling test where `dtype` is bfloat16 and this machine's torch cannot run it."""
    import pytest

    if dtype == "bfloat16" and (why := bf16_linear_unsupported()) is not None:
        pytest.skip(why)
