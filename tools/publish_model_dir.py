"""The converter's output directory: recognising an up-to-date one, and putting a new one in place in one rename.

An interrupted run must never leave a directory that looks complete, and a second run over an up-to-date
directory must do nothing; both rest on a marker file written last, naming the input it was made from.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any

from tools.gguf_reading import ConversionError

MARKER = "conversion.json"
# Bump when the output changes, so directories written by an older converter are redone.
CONVERTER_VERSION = 2
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "quantized.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER,
)


def fingerprint(gguf_path: Path) -> dict[str, Any]:
    """What identifies a conversion's input. Size and mtime, not a hash: hashing a multi-GB checkpoint on
    every start would cost more than it protects against. The directory is left out so that the same file
    reinstalled elsewhere with its timestamp kept still counts as converted."""
    stat = gguf_path.stat()
    return {
        "converter_version": CONVERTER_VERSION,
        "gguf_name": gguf_path.name,
        "gguf_size": stat.st_size,
        "gguf_mtime_ns": stat.st_mtime_ns,
    }


def holds_conversion_of(out_dir: Path, source: dict[str, Any]) -> bool:
    try:
        recorded = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return recorded == source and all((out_dir / name).is_file() for name in OUTPUT_FILES)


def refuse_foreign_directory(out_dir: Path) -> None:
    """We replace our own stale conversions, never a directory someone else put there."""
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MARKER).exists():
        raise ConversionError(f"{out_dir} exists and was not written by this converter; remove it or use another --out")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"{out_dir} exists and is not a directory")


def work_dir(out_dir: Path, purpose: str) -> Path:
    # A hidden sibling: same filesystem (so the final rename is atomic) and ignored by loaders that scan models/.
    return out_dir.with_name(f".{out_dir.name}.{purpose}-{os.getpid()}")


def remove_abandoned_work_dirs(out_dir: Path) -> None:
    """Deletes work directories left by killed runs (their pid no longer exists); a checkpoint's worth each."""
    for leftover in out_dir.parent.glob(f".{out_dir.name}.*-*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _process_exists(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def publish(work: Path, out_dir: Path) -> None:
    """Puts the finished `work` directory at `out_dir`. A directory cannot be renamed over a non-empty one,
    so a previous conversion is first moved aside; at no moment is a partial directory at `out_dir`."""
    if out_dir.exists():
        old = work_dir(out_dir, "old")
        out_dir.rename(old)
        work.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        work.rename(out_dir)


def write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
