"""One model's weights per fleet: which executors may serve side by side.

Executors of one fleet take each other's requests (a lost one's, a drained one's, a rebalanced one's, with their
KV or recomputed) and the gateway serves them all under one model name, so a request must not change model
halfway or depend on where it landed. Two executors serve the same weights when they load the same model
directory (by name) and compute with its values: `--quantization` none and gguf do (gguf multiplies the GGUF's
blocks, whose dequantized values are the directory's float weights, and gives their logits to the bit);
int8, int4 and fp8 each compute with weights of their own. The executors connected first set the fleet's
weights; one whose weights differ is refused (not routed to, tried again like an unreachable one), so it joins
once the others are gone, as at the end of a rolling update from one quantization to another. A scheduler told
its model (--served-model) refuses every executor of another one, the first included.
"""

from __future__ import annotations

import os

# Quantizations whose weights are the checkpoint's own values.
EXACT = ("", "none", "gguf")


def weights_of(model: str, quantization: str) -> tuple[str, str]:
    """(model directory name, "float" or the quantization that changes the values)."""
    return os.path.basename(model.rstrip("/")), "float" if quantization in EXACT else quantization


def refusal(mine: tuple[str, str], fleet: set[tuple[str, str]], model: str = "") -> str:
    """Why an executor serving `mine` may not join executors serving `fleet` ("" if it may). `model`, where set,
    is the only model directory name this scheduler serves (a deployment of several models runs a scheduler per
    model, docs/multimodel.md): an executor of another model pointed at it is refused even when it comes first."""
    if model and mine[0] != model:
        return (f"serves {_name(mine)} while this scheduler serves {model} (--served-model): an executor joins "
                f"the scheduler of its own model")
    other = next((w for w in sorted(fleet) if w != mine), None)
    if other is None:
        return ""
    return (f"serves {_name(mine)} while the fleet's executors serve {_name(other)}: a fleet serves one model's "
            f"weights (it is tried again, and joins once those executors are gone)")


def _name(w: tuple[str, str]) -> str:
    return f"{w[0]} ({'unquantized or its GGUF blocks' if w[1] == 'float' else w[1]})"
