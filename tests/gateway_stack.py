"""The three services as processes on loopback ports, with the tiny random model and the embedded model's
tokenizer: a stack that starts in seconds, for tests of the gateway's edge rather than of the model."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from helpers import free_ports, log_tail, stop_processes, wait_http_ready
from tiny_model import kv_bytes, write_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = ROOT / "models" / "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 128
VOCAB = 49152   # the embedded model's tokenizer's


class Stack(NamedTuple):
    url: str          # the gateway's HTTP root
    grpc: str         # the gateway's gRPC address
    model: Path       # the model directory the gateway and the executor read
    gateway: subprocess.Popen
    logs: list[Path]


def tiny_model_with_tokenizer(path: Path, **overrides) -> Path:
    """The tiny random Llama, sized to the embedded model's vocabulary, with its tokenizer and chat template."""
    if not (EMBEDDED / "tokenizer.json").exists():
        pytest.skip("embedded model not prepared (make model): its tokenizer is needed")
    model = write_tiny_llama(path, vocab_size=VOCAB, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, model / name)
    return model


@contextlib.contextmanager
def tiny_stack(tmp: Path, gateway_args: list[str] = (), env: dict | None = None, max_model_len: int = MAX_MODEL_LEN):
    """Executor, scheduler and gateway (with `gateway_args` and extra environment `env`), ready; stopped on
    exit, failing if one of them died meanwhile. The KV cache holds 1024 tokens."""
    model = tiny_model_with_tokenizer(tmp / "model", max_position_embeddings=max(max_model_len, 256))
    ex, sc, http, gw, ex_metrics, sc_metrics = free_ports(6)
    py = sys.executable
    cmds = {
        "executor": [py, "-m", "executor_service.server", "--model", str(model), "--address", f"127.0.0.1:{ex}",
                     "--block-size", "4", "--kv-cache-memory", str(kv_bytes(256)), "--max-num-seqs", "8",
                     "--max-model-len", str(max_model_len), "--metrics-address", f"127.0.0.1:{ex_metrics}"],
        "scheduler": [py, "-m", "scheduler_service.server", "--executors", f"127.0.0.1:{ex}", "--address",
                      f"127.0.0.1:{sc}", "--metrics-address", f"127.0.0.1:{sc_metrics}"],
        "gateway": [py, "-m", "gateway.server", "--model", str(model), "--scheduler", f"127.0.0.1:{sc}",
                    "--port", str(http), "--grpc-address", f"127.0.0.1:{gw}", *gateway_args],
    }
    logs = [tmp / f"{name}.log" for name in cmds]
    procs = {}
    for (name, cmd), log in zip(cmds.items(), logs, strict=True):
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                       env={**os.environ, **(env or {})} if name == "gateway" else None)
    url = f"http://127.0.0.1:{http}"
    try:
        wait_http_ready(url, procs, logs=logs)
        yield Stack(url, f"127.0.0.1:{gw}", model, procs["gateway"], logs)
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        assert not dead, f"exited during the tests: {dead}\n" + "\n".join(log_tail(p) for p in logs)
    finally:
        stop_processes(procs)
