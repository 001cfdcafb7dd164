"""`stepwire serve`: the whole stack on localhost, as one process per service, kept up.

Executors are the part meant to come and go: one that dies is started again on the same address (the
scheduler moves its requests meanwhile and takes it back when it answers), with a growing pause if it keeps
dying at start-up. The scheduler and the gateway are the stack: if either exits, everything stops.

The host's cores are split between the executors (`--threads`), since each would otherwise start a thread
per core and they would fight over them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from stepwire.contract.settings import ServiceSettings, load


class ServeSettings(ServiceSettings):
    """Start executors, scheduler and gateway on localhost. Every flag is also STEPWIRE_SERVE_<FLAG>."""

    model_config = SettingsConfigDict(env_prefix="STEPWIRE_SERVE_", cli_prog_name="stepwire serve")

    model: str = Field("models/SmolLM2-135M-Instruct", description="Hugging Face model directory")
    port: int = Field(8000, description="HTTP port of the gateway")
    grpc_port: int = Field(50050, description="gRPC port of the gateway (stepwire.v1)")
    scheduler_port: int = Field(50051)
    executors: int = Field(1, ge=1, description="local executors; they take ports from --executor-port up")
    executor_port: int = Field(50061, description="port of the first executor")
    tensor_parallel_size: int = Field(1, ge=1, description="ranks per executor (processes that split the model)")
    threads: int = Field(0, ge=0, description="torch threads per executor rank; 0: the host's cores split evenly "
                         "between all ranks of all executors")
    kv_cache_memory: int = Field(1 << 30, ge=1, description="bytes for each executor's KV cache")
    deterministic: bool = Field(False, description="executors with batch-invariant kernels: the same tokens in "
                                "any batch, chunking or executor, in bfloat16 as in float32 (README)")
    scheduler_metrics_port: int = Field(9091, description="Prometheus /metrics of the scheduler")
    executor_metrics_port: int = Field(9092, description="Prometheus /metrics of the first executor (then +1)")
    tls: bool = Field(True, description="mTLS between the services, with a development CA (--no-tls: plaintext "
                      "on loopback)")
    certs_dir: str = Field("", description="where `stepwire certs` wrote (or will write) the certificates; "
                           "empty: a fresh CA in a temporary folder, removed on exit")


@dataclass
class Child:
    name: str
    command: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    died_at: float | None = None
    pause: float = 0.5          # before the next restart; doubles while it keeps dying young

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command)
        self.started_at = time.monotonic()

    def exited(self) -> int | None:
        return self.proc.poll()


def threads_per_executor(a: ServeSettings) -> int:
    if a.threads:
        return a.threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = a.executors * a.tensor_parallel_size
    return 0 if ranks == 1 else max(1, cores // ranks)


def children(a: ServeSettings, certs: Path | None = None) -> tuple[list[Child], list[Child]]:
    """(executors, the rest) as commands; every service is this Python running its module, with its own
    certificate from `certs` (a `stepwire certs` folder) when given."""
    py = sys.executable

    def tls(service: str) -> list[str]:
        return ["--tls-dir", str(certs / service)] if certs is not None else []

    addresses = [f"127.0.0.1:{a.executor_port + i}" for i in range(a.executors)]
    sc = f"127.0.0.1:{a.scheduler_port}"
    threads = threads_per_executor(a)
    executors = [Child(f"executor-{i}", [
        py, "-m", "executor_service.server", "--model", a.model, "--address", address,
        "--kv-cache-memory", str(a.kv_cache_memory), "--threads", str(threads),
        "--tensor-parallel-size", str(a.tensor_parallel_size), *(["--deterministic"] if a.deterministic else []),
        "--metrics-address", f"127.0.0.1:{a.executor_metrics_port + i}", *tls("executor")])
        for i, address in enumerate(addresses)]
    stack = [
        Child("scheduler", [py, "-m", "scheduler_service.server", "--executors", ",".join(addresses), "--address", sc,
                            "--metrics-address", f"127.0.0.1:{a.scheduler_metrics_port}", *tls("scheduler")]),
        Child("gateway", [py, "-m", "gateway.server", "--model", a.model, "--scheduler", sc, "--port", str(a.port),
                          "--grpc-address", f"127.0.0.1:{a.grpc_port}", *tls("gateway")]),
    ]
    return executors, stack


def certificates(a: ServeSettings) -> tuple[Path | None, Path | None]:
    """(the certificates' folder, a temporary folder to remove on exit); the CA is made if there is none."""
    if not a.tls:
        return None, None
    from security.dev_certs import make_dev_certs

    if a.certs_dir:
        d = Path(a.certs_dir)
        # A folder from before certificates named their roles has no operator: every peer would refuse them.
        if not (d / "operator" / "tls.crt").exists():
            make_dev_certs(d)
        return d, None
    d = Path(tempfile.mkdtemp(prefix="stepwire-certs-"))
    return make_dev_certs(d), d


def serve(argv: list[str]) -> None:
    a = load(ServeSettings, argv)
    certs, temporary = certificates(a)
    executors, stack = children(a, certs)
    everyone = executors + stack
    for c in everyone:
        c.start()

    def stop(*_):
        for c in everyone:
            if c.proc.poll() is None:
                c.proc.terminate()
        for c in everyone:
            try:
                c.proc.wait(timeout=30)          # an executor drains first
            except subprocess.TimeoutExpired:
                c.proc.kill()
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    url = f"http://127.0.0.1:{a.port}"
    ready = False
    while True:
        for c in stack:
            if c.name == "scheduler":
                keep_up(c)     # the gateway holds its requests meanwhile and resubmits them to the new one
            elif c.exited() is not None:
                print(f"stepwire: the {c.name} exited with {c.proc.returncode}; stopping", file=sys.stderr)
                stop()
        for c in executors:
            keep_up(c)
        if not ready:
            ready = _healthy(url)
            if ready:
                _announce(a, url, certs)
        time.sleep(0.5 if not ready else 1)


def keep_up(c: Child) -> None:
    """Start an executor or the scheduler again once it has exited, after a pause that grows while it dies
    young."""
    code = c.exited()
    if code is None:
        return
    if c.died_at is None:
        c.died_at = time.monotonic()
        c.pause = min(c.pause * 2, 30) if c.died_at - c.started_at < 10 else 1.0
        print(f"stepwire: {c.name} exited with {code}; starting it again in {c.pause:.0f}s", file=sys.stderr,
              flush=True)
    if time.monotonic() - c.died_at >= c.pause:
        c.died_at = None
        c.restarts += 1
        c.start()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _announce(a: ServeSettings, url: str, certs: Path | None) -> None:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    metrics = ", ".join(f"http://127.0.0.1:{a.executor_metrics_port + i}/metrics" for i in range(a.executors))
    print(f"\nstepwire is ready: OpenAI-compatible API at {url}/v1 (model {model!r}); gRPC stepwire.v1 at "
          f"127.0.0.1:{a.grpc_port}; scheduler at 127.0.0.1:{a.scheduler_port}; {a.executors} executor(s) from "
          f"port {a.executor_port}, {'mTLS between them' if a.tls else 'plaintext'}"
          f"{f' (the scheduler answers Stats to the operator certificate in {certs}/operator)' if certs else ''}"
          f". Prometheus metrics at "
          f"{url}/metrics (gateway), "
          f"http://127.0.0.1:{a.scheduler_metrics_port}/metrics (scheduler) and {metrics} (executors). "
          f"Ctrl-C stops everything.\n", flush=True)
