#!/usr/bin/env python3
"""stepwire against vLLM's own CPU build on the same machine: same model directory, same dtype, same client.

Both serve the embedded model over the OpenAI API with the same KV cache memory (4 GiB, or
VLLM_CPU_KVCACHE_SPACE; `stepwire serve --kv-cache-memory`; vLLM through
`../shared/peers/vllm_cpu/serve.sh`, once with `VLLM_CPU_OMP_THREADS_BIND=0-1` and once with its default
binding, which keeps a core for its API server; the better of the two counts). One third-party load client
drives both: `vllm bench serve --backend openai-chat` from the peer's venv, random prompts, `--ignore-eos`.
Workloads (`--workloads`):
- chat: prompts of 64-448 tokens, 32-224 out (random lengths);
- prefill: about 1,000 in, 64 out;
- decode: about 64 in, 512 out;
at each of `--concurrency` (default 1, 8, 32, 64), with `--waves` times the concurrency of prompts (at least
`--min-prompts`). All servers stay up; each cell runs on one at a time, their order alternating cell by cell.

Prints a table and `RESULT peers cpu=<model name> dtype=<...> throughput_vs_vllm=<worst stepwire ÷ vLLM output
tok/s over the workloads at c32 and c64> ttft_p50_vs_vllm=<worst ratio of median TTFTs> tpot_c1_vs_vllm=<worst
ratio of median TPOTs at c1>` over what ran (a ratio over nothing is n/a).

Usage: bench/peers.py --vllm-venv DIR [--dtype float32|bfloat16] [--workloads chat,prefill,decode]
[--concurrency 1,8,32,64] [--waves 2] [--bindings 0-1,auto]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from determinism import cpu_model  # noqa: E402
from serving import MODEL, free_port, start_stack, wait_ready  # noqa: E402

from executor_service.engine.runner_config import default_dtype  # noqa: E402

PEERS = ROOT.parent / "shared" / "peers" / "vllm_cpu"
NAME = "SmolLM2-135M-Instruct"
WORKLOADS = {"chat": (256, 128, 0.75), "prefill": (1000, 64, 0.0), "decode": (64, 512, 0.0)}   # in, out, range


def start_vllm(venv: str, dtype: str, binding: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ)
    if binding != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = binding
    log = open(tempfile.gettempdir() + f"/peers-vllm-{binding}.log", "w")   # noqa: SIM115 (the server's life)
    proc = subprocess.Popen(["bash", str(PEERS / "serve.sh"), venv, str(MODEL), str(port), dtype, NAME],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url + "/v1/models", f"vLLM CPU ({binding}; log {log.name})", seconds=900)
    return proc, url


def load(venv: str, url: str, workload: str, concurrency: int, prompts: int, seed: int) -> dict:
    """One `vllm bench serve` run: its result JSON (output_throughput, median_ttft_ms, median_tpot_ms, ...)."""
    n_in, n_out, spread = WORKLOADS[workload]
    with tempfile.TemporaryDirectory() as out:
        cmd = [f"{venv}/bin/vllm", "bench", "serve", "--backend", "openai-chat", "--base-url", url,
               "--endpoint", "/v1/chat/completions", "--model", NAME, "--tokenizer", str(MODEL),
               "--dataset-name", "random", "--random-input-len", str(n_in), "--random-output-len", str(n_out),
               "--random-range-ratio", str(spread), "--num-prompts", str(prompts),
               "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed),
               "--save-result", "--result-dir", out, "--result-filename", "r.json"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed against {url}: {done.stderr[-2000:]}")
        return json.loads((Path(out) / "r.json").read_text())


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 15)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)


def worst(pairs: list[tuple[float, float]], higher_is_better: bool) -> str:
    """The worst stepwire ÷ vLLM ratio of (stepwire, vLLM) pairs, or n/a."""
    ratios = [a / b for a, b in pairs if b > 0]
    if not ratios:
        return "n/a"
    return f"{(min(ratios) if higher_is_better else max(ratios)):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-venv", required=True, help="made by ../shared/peers/vllm_cpu/setup.sh")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="both systems' (default: stepwire's for this CPU)")
    ap.add_argument("--workloads", default="chat,prefill,decode")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--waves", type=int, default=2, help="prompts per run: this many times the concurrency")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--bindings", default="0-1,auto", help="vLLM's VLLM_CPU_OMP_THREADS_BIND values to try")
    a = ap.parse_args()
    dtype = a.dtype or default_dtype("cpu")
    workloads, levels = a.workloads.split(","), [int(c) for c in a.concurrency.split(",")]
    runs: dict[tuple[str, str, int], dict] = {}

    # All servers up at once (an idle one takes no CPU), each cell measured on one system at a time, their order
    # alternating from cell to cell.
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    bindings = [f"vllm {b}" for b in a.bindings.split(",")]
    try:
        # The KV cache vLLM gets from serve.sh (VLLM_CPU_KVCACHE_SPACE, GiB), so that neither preempts sooner.
        kv_gib = int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
        proc, url, _ = start_stack(env=os.environ | {"STEPWIRE_EXECUTOR_DTYPE": dtype}, tls=False,
                                   extra=("--kv-cache-memory", str(kv_gib << 30)))
        servers["stepwire"] = (proc, url)
        for binding in a.bindings.split(","):
            servers[f"vllm {binding}"] = start_vllm(a.vllm_venv, dtype, binding)
        for _, url in servers.values():
            load(a.vllm_venv, url, "chat", 2, 2, seed=99)     # warm-up, not measured
        cell = 0
        for w in workloads:
            for c in levels:
                order = list(servers) if cell % 2 == 0 else list(servers)[::-1]
                cell += 1
                for system in order:
                    t = time.time()
                    runs[(system, w, c)] = r = load(a.vllm_venv, servers[system][1], w, c,
                                                    max(a.min_prompts, a.waves * c), seed=c)
                    print(f"{system:>14} {w:>8} c{c:<3} {r['output_throughput']:8.1f} tok/s  TTFT p50 "
                          f"{r['median_ttft_ms']:8.0f} ms  TPOT p50 {r['median_tpot_ms']:7.1f} ms  "
                          f"({time.time() - t:.0f} s)", flush=True)
    finally:
        for name, (proc, _) in servers.items():
            if name == "stepwire":
                proc.terminate()
                proc.wait(timeout=60)
            else:
                stop(proc)

    def vllm_best(w: str, c: int) -> dict:
        return max((runs[(b, w, c)] for b in bindings), key=lambda r: r["output_throughput"])

    print(f"\ncpu: {cpu_model()}  dtype: {dtype}  client: vllm bench serve --backend openai-chat, --ignore-eos")
    print(f"{'workload':>8} {'conc':>4} {'stepwire tok/s':>14} {'vLLM tok/s':>10} {'ratio':>6} {'TTFT p50 ratio':>14} "
          f"{'TPOT p50 ratio':>14}")
    tput, ttft, tpot, ttft_loaded = [], [], [], []
    for w in workloads:
        for c in levels:
            s, v = runs[("stepwire", w, c)], vllm_best(w, c)
            print(f"{w:>8} {c:>4} {s['output_throughput']:>14.1f} {v['output_throughput']:>10.1f} "
                  f"{s['output_throughput'] / v['output_throughput']:>6.2f} "
                  f"{s['median_ttft_ms'] / v['median_ttft_ms']:>14.2f} "
                  f"{s['median_tpot_ms'] / v['median_tpot_ms']:>14.2f}")
            if c in (32, 64):
                tput.append((s["output_throughput"], v["output_throughput"]))
                ttft_loaded.append((s["median_ttft_ms"], v["median_ttft_ms"]))
            ttft.append((s["median_ttft_ms"], v["median_ttft_ms"]))
            if c == 1:
                tpot.append((s["median_tpot_ms"], v["median_tpot_ms"]))
    # At c1 both prefill one prompt on the same cores: the ratio there is the prefill's speed, not the queueing.
    print(f"TTFT p50 ratio at c32 and c64 only (worst): {worst(ttft_loaded, False)}")
    print(f"RESULT peers cpu={cpu_model().replace(' ', '_')} dtype={dtype} throughput_vs_vllm={worst(tput, True)} "
          f"ttft_p50_vs_vllm={worst(ttft, False)} tpot_c1_vs_vllm={worst(tpot, False)}")


if __name__ == "__main__":
    main()
