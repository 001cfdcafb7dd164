"""The `stepwire` command: serve the whole stack, run one service, or stream a completion.

It sits above the services: it starts them as processes (or runs one in this process) and never shares
their code, so each service stays importable on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import httpx
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from stepwire.contract.settings import ServiceSettings, load

USAGE = """stepwire serve [--model DIR] [--port 8000]    start executor, scheduler and gateway on localhost
stepwire executor|scheduler|gateway [...]      start one service (--help for its flags)
stepwire generate "prompt" [--max-tokens N]    stream a completion from a running gateway"""


class ServeSettings(ServiceSettings):
    """Start executor, scheduler and gateway on localhost. Every flag is also STEPWIRE_SERVE_<FLAG>."""

    model_config = SettingsConfigDict(env_prefix="STEPWIRE_SERVE_", cli_prog_name="stepwire serve")

    model: str = Field("models/SmolLM2-135M-Instruct", description="Hugging Face model directory")
    port: int = Field(8000, description="HTTP port of the gateway")
    grpc_port: int = Field(50050, description="gRPC port of the gateway (stepwire.v1)")
    scheduler_port: int = Field(50051)
    executor_port: int = Field(50061)
    kv_cache_memory: int = Field(1 << 30, ge=1, description="bytes for the executor's KV cache")
    scheduler_metrics_port: int = Field(9091, description="Prometheus /metrics of the scheduler")
    executor_metrics_port: int = Field(9092, description="Prometheus /metrics of the executor")


def serve(argv: list[str]) -> None:
    a = load(ServeSettings, argv)
    py = sys.executable
    ex, sc = f"127.0.0.1:{a.executor_port}", f"127.0.0.1:{a.scheduler_port}"
    commands = {
        "executor": [py, "-m", "executor_service.server", "--model", a.model, "--address", ex,
                     "--kv-cache-memory", str(a.kv_cache_memory), "--metrics-address",
                     f"127.0.0.1:{a.executor_metrics_port}"],
        "scheduler": [py, "-m", "scheduler_service.server", "--executors", ex, "--address", sc, "--metrics-address",
                      f"127.0.0.1:{a.scheduler_metrics_port}"],
        "gateway": [py, "-m", "gateway.server", "--model", a.model, "--scheduler", sc, "--port", str(a.port),
                    "--grpc-address", f"127.0.0.1:{a.grpc_port}"],
    }
    procs = {name: subprocess.Popen(cmd) for name, cmd in commands.items()}

    def stop(*_):
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    url = f"http://127.0.0.1:{a.port}"
    while True:
        for name, p in procs.items():
            if p.poll() is not None:
                print(f"stepwire: the {name} exited with {p.returncode}; stopping", file=sys.stderr)
                stop()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    print(f"\nstepwire is ready: OpenAI-compatible API at {url}/v1 (model {model!r}); gRPC stepwire.v1 at "
          f"127.0.0.1:{a.grpc_port}; scheduler at {sc}. Prometheus metrics at {url}/metrics (gateway), "
          f"http://127.0.0.1:{a.scheduler_metrics_port}/metrics (scheduler) and "
          f"http://127.0.0.1:{a.executor_metrics_port}/metrics (executor). Ctrl-C stops everything.\n", flush=True)
    while True:
        for name, p in procs.items():
            if p.poll() is not None:
                print(f"stepwire: the {name} exited with {p.returncode}; stopping", file=sys.stderr)
                stop()
        time.sleep(1)


def generate(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="stepwire generate", description="Stream a chat completion.")
    ap.add_argument("prompt")
    ap.add_argument("--url", default=os.environ.get("STEPWIRE_URL", "http://127.0.0.1:8000"))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    a = ap.parse_args(argv)
    model = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": a.prompt}], "stream": True,
            "max_tokens": a.max_tokens, "temperature": a.temperature}
    with httpx.stream("POST", a.url + "/v1/chat/completions", json=body, timeout=None) as r:
        if r.status_code != 200:
            sys.exit(f"stepwire: {r.status_code} {r.read().decode()}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    print(choice.get("delta", {}).get("content", ""), end="", flush=True)
    print()


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(USAGE)
        return
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "serve":
        serve(rest)
    elif cmd == "generate":
        generate(rest)
    elif cmd == "executor":
        from executor_service.server import main as run
        run(rest)
    elif cmd == "scheduler":
        from scheduler_service.server import main as run
        run(rest)
    elif cmd == "gateway":
        from gateway.server import main as run
        run(rest)
    else:
        sys.exit(f"stepwire: unknown command {cmd!r}\n{USAGE}")


if __name__ == "__main__":
    main()
