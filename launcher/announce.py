"""The line `stepwire serve` prints once the stack answers: where each API and each /metrics is."""

from __future__ import annotations

import os
from pathlib import Path

import httpx


def announce(a, url: str, certs: Path | None) -> None:
    """`a`: serve's settings (local_stack.ServeSettings)."""
    operator = f" (the scheduler answers Stats to the operator certificate in {certs}/operator)" if certs else ""
    print(f"\nstepwire is ready: OpenAI-compatible API at {url}/v1 (model {_served_model(a, url)!r}); gRPC "
          f"stepwire.v1 at 127.0.0.1:{a.grpc_port}; scheduler at 127.0.0.1:{a.scheduler_port}; {a.executors} "
          f"executor(s) from port {a.executor_port}, {'mTLS between them' if a.tls else 'plaintext'}{operator}. "
          f"Prometheus "
          f"metrics at {url}/metrics (gateway), http://127.0.0.1:{a.scheduler_metrics_port}/metrics (scheduler) "
          f"and {_executor_metrics(a)} (executors). Ctrl-C stops everything.\n", flush=True)


def _served_model(a, url: str) -> str:
    """The name clients use, as the gateway lists it (with the API key the gateway was given, if any); the
    model folder's name when the list cannot be read: a ready message is no reason to stop the stack."""
    keys = [k.strip() for k in os.environ.get("STEPWIRE_API_KEY", "").split(",") if k.strip()]
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    try:
        return httpx.get(url + "/v1/models", headers=headers, timeout=5).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return Path(a.model).name


def _executor_metrics(a) -> str:
    return ", ".join(f"http://127.0.0.1:{a.executor_metrics_port + i}/metrics" for i in range(a.executors))
