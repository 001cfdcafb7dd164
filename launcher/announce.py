"""The line `stepwire serve` prints once the stack answers: where each API and each /metrics is."""

from __future__ import annotations

import os
from pathlib import Path

import httpx


def announce(a, url: str, certs: Path | None, scheduler_metrics_ports: list[int]) -> None:
    """`a`: serve's settings (local_stack.ServeSettings); one scheduler /metrics port per model."""
    n = len(a.model)
    operator = f" (the scheduler answers Stats to the operator certificate in {certs}/operator)" if certs else ""
    schedulers = ", ".join(f"127.0.0.1:{a.scheduler_port + m}" for m in range(n))
    scheduler_metrics = ", ".join(f"http://127.0.0.1:{port}/metrics" for port in scheduler_metrics_ports)
    print(f"\nstepwire is ready: OpenAI-compatible API at {url}/v1 (model {_served_models(a, url)}); gRPC "
          f"stepwire.v1 at 127.0.0.1:{a.grpc_port}; scheduler{'s' if n > 1 else ''} at {schedulers}; "
          f"{a.executors} executor(s){' per model' if n > 1 else ''} from port {a.executor_port}, "
          f"{'mTLS between them' if a.tls else 'plaintext'}{operator}. Prometheus "
          f"metrics at {url}/metrics (gateway), {scheduler_metrics} (scheduler{'s' if n > 1 else ''}) "
          f"and {_executor_metrics(a)} (executors). Ctrl-C stops everything.\n", flush=True)


def _served_models(a, url: str) -> str:
    """The names clients use, as the gateway lists them (with the API key the gateway was given, if any); the
    model folders' names when the list cannot be read: a ready message is no reason to stop the stack."""
    keys = [k.strip() for k in os.environ.get("STEPWIRE_API_KEY", "").split(",") if k.strip()]
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    try:
        names = [c["id"] for c in httpx.get(url + "/v1/models", headers=headers, timeout=5).json()["data"]
                 if c.get("parent") is None]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        names = [Path(m).name for m in a.model]
    return ", ".join(map(repr, names))


def _executor_metrics(a) -> str:
    return ", ".join(f"http://127.0.0.1:{a.executor_metrics_port + i}/metrics"
                     for i in range(a.executors * len(a.model)))
