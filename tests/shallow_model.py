"""The embedded model cut to its first few layers, for tests of the engine's mechanics.

Same tokenizer, same real weights and the same shapes in every layer, so every kernel, the sampler, the
prefix cache and tensor parallelism run as they do on the whole model, at under a third of its cost per token
(the tied 49152-row embedding stays whole and then dominates). What such a test asserts (the same bits alone
and among neighbours, the same tokens with and without speculation, with peft's) does not depend on depth;
its greedy text is gibberish, so tests of the model itself (the conversion, agreement with transformers, what
a grounded prompt makes it copy) keep the whole model."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

from conftest import MODEL

LAYERS = 4
SHALLOW = MODEL.parent / f".{MODEL.name}-{LAYERS}-layers"     # git-ignored, beside the model it is cut from


def block_bytes(dtype: str = "float32") -> int:
    """One KV block of the cut in `dtype` at the default block size: K and V, every layer, 16 slots, 3 KV heads
    of 64."""
    from executor_service.engine.runner_config import DTYPES
    return 2 * LAYERS * 16 * 3 * 64 * DTYPES[dtype].itemsize


BLOCK_BYTES = block_bytes("float32")


def shallow_model() -> Path:
    """The cut, written by the first pytest worker that asks (0.2 s) and found by the others; written again
    when the model was converted again. Workers that find it current read it without the lock."""
    stamp = (MODEL / "conversion.json").read_text()
    current = lambda: (SHALLOW / "conversion.json").exists() and (SHALLOW / "conversion.json").read_text() == stamp  # noqa: E731
    if current():
        return SHALLOW
    with open(MODEL.parent / f".{SHALLOW.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one worker cuts; the others wait and find its cut
        if not current():
            shutil.rmtree(SHALLOW, ignore_errors=True)      # cut from an earlier conversion, or half removed
            tmp = cut_model(MODEL, Path(tempfile.mkdtemp(dir=MODEL.parent, prefix=".cutting-")))
            os.rename(tmp, SHALLOW)
    return SHALLOW


def cut_model(src: Path, dst: Path, layers: int = LAYERS) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = json.loads((src / "config.json").read_text())
    assert layers < cfg["num_hidden_layers"], cfg
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        keep = {k: f.get_tensor(k) for k in f.keys()
                if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": layers}, indent=2))
    for name in sorted(os.listdir(src), key=lambda n: n == "conversion.json"):   # the stamp last
        if name not in ("config.json", "model.safetensors"):
            shutil.copy(src / name, dst / name)
    return dst
