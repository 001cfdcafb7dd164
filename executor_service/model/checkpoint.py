"""A Hugging Face checkpoint's tensors (one safetensors file, or shards with an index), each read on demand."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from executor_service.model.config import ModelLoadError


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shards named in the index are missing: {missing}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json")


class Checkpoint:
    """A checkpoint's tensors by name, each read on demand, and only the rows or columns asked for."""

    def __init__(self, path: Path):
        self.path = path
        self._file_of = {}
        for f in weight_files(path):
            st = safe_open(str(f), framework="pt")
            self._file_of.update(dict.fromkeys(st.keys(), st))
        self.taken: set[str] = set()

    def skip(self, *names: str) -> None:
        """Names served from elsewhere (quantized_loader.py): not read, and not left over."""
        self.taken.update(names)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> list[int]:
        return self._file_of[name].get_slice(name).get_shape()

    def take(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
             ) -> torch.Tensor:
        if name not in self._file_of:
            raise ModelLoadError(f"{self.path}: checkpoint lacks {name}")
        self.taken.add(name)
        view = self._file_of[name].get_slice(name)
        if rows is None and cols is None:
            return view[:]
        if cols is None:
            return view[rows[0]:rows[1]]
        lo, hi = rows or (0, view.get_shape()[0])
        return view[lo:hi, cols[0]:cols[1]]

    def leftovers(self) -> list[str]:
        # Rotary inverse frequencies that some checkpoints carry are recomputed, not loaded.
        return sorted(k for k in self._file_of if k not in self.taken and not k.endswith("rotary_emb.inv_freq"))
