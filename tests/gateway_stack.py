"""The three services as processes on loopback ports, with the tiny random model and the embedded model's
tokenizer: a stack that starts in seconds, for tests of the gateway's edge rather than of the model."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
from tiny_model import executor_dtype, kv_bytes, write_tiny_llama

from launcher.processes import Service, Stack, flag_dict

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = ROOT / "models" / "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 128
VOCAB = 49152   # the embedded model's tokenizer's


class TinyStack(NamedTuple):
    url: str          # the gateway's HTTP root
    grpc: str         # the gateway's gRPC address
    model: Path       # the model directory the gateway and the executor read
    gateway: subprocess.Popen
    logs: list[Path]
    scheduler_metrics: str = ""   # the scheduler's /metrics URL
    executor_metrics: str = ""    # the executor's
    scheduler: str = ""           # the scheduler's gRPC address (its Stats)
    executor: str = ""            # the executor's (its Describe)


def tiny_model_with_tokenizer(path: Path, **overrides) -> Path:
    """The tiny random Llama, sized to the embedded model's vocabulary, with its tokenizer and chat template."""
    if not (EMBEDDED / "tokenizer.json").exists():
        pytest.skip("embedded model not prepared (make model): its tokenizer is needed")
    model = write_tiny_llama(path, vocab_size=VOCAB, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED / name, model / name)
    return model


@contextlib.contextmanager
def tiny_stack(tmp: Path, gateway_args: list[str] = (), env: dict | None = None, max_model_len: int = MAX_MODEL_LEN,
               executor_flags: dict | None = None, kv_blocks: int = 256, scheduler_flags: dict | None = None,
               chat_template: str | None = None):
    """Executor (with extra `executor_flags`), scheduler (with `scheduler_flags`) and gateway (with `gateway_args`
    and extra environment `env`), ready; stopped on exit, failing if one of them died meanwhile. The KV cache
    holds `kv_blocks` blocks of 4 tokens, in the executor's dtype. `chat_template`: the model's, in place of the
    embedded model's."""
    model = tiny_model_with_tokenizer(tmp / "model", max_position_embeddings=max(max_model_len, 256))
    if chat_template is not None:
        config = json.loads((model / "tokenizer_config.json").read_text())
        (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat_template}))
    dtype = (executor_flags or {}).get("--dtype") or executor_dtype()
    executor = {"--model": model, "--block-size": 4, "--kv-cache-memory": kv_bytes(kv_blocks, dtype=dtype),
                "--max-num-seqs": 8, "--max-model-len": max_model_len, **(executor_flags or {})}
    with Stack([Service("executor", flags=executor),
                Service("scheduler", flags=scheduler_flags or {}),
                Service("gateway", flags={"--model": model, **flag_dict(gateway_args)}, env=env or {})], tmp) as s:
        yield TinyStack(s["gateway"].url, s["gateway"].address, model, s.procs["gateway"], s.logs(),
                        f"http://{s['scheduler'].flags['--metrics-address']}/metrics",
                        f"http://{s['executor'].flags['--metrics-address']}/metrics", s["scheduler"].address,
                        s["executor"].address)
