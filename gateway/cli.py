"""The `stepwire` command: serve the whole stack, run one service, or stream a completion."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import httpx

USAGE = """stepwire serve [--model DIR] [--port 8000]    start executor, scheduler and gateway on localhost
stepwire executor|scheduler|gateway [...]      start one service (--help for its flags)
stepwire generate "prompt" [--max-tokens N]    stream a completion from a running gateway"""


def serve(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="stepwire serve", description="Start the three services on localhost.")
    ap.add_argument("--model", default=os.environ.get("STEPWIRE_MODEL", "models/SmolLM2-135M-Instruct"))
    ap.add_argument("--port", type=int, default=8000, help="HTTP port of the gateway")
    ap.add_argument("--executor-port", type=int, default=50061)
    ap.add_argument("--scheduler-port", type=int, default=50051)
    ap.add_argument("--grpc-port", type=int, default=50050, help="gRPC port of the gateway (stepwire.v1)")
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    ap.add_argument("--scheduler-metrics-port", type=int, default=9091, help="Prometheus /metrics of the scheduler")
    ap.add_argument("--executor-metrics-port", type=int, default=9092, help="Prometheus /metrics of the executor")
    a = ap.parse_args(argv)
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
