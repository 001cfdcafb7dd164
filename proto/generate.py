#!/usr/bin/env python3
"""Generate the Python modules of the .proto contract into the `stepwire` package.

    python proto/generate.py            # regenerate in place (after editing a .proto)
    python proto/generate.py --check    # exit 1 if the committed modules differ from a fresh generation

The generated code is committed so that installing stepwire needs no protoc; tests/test_proto.py runs the
check, so the modules can never drift from the contract.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGES = ("stepwire/v1", "stepwire/internal")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("stepwire/**/*.proto"))


def generate(out: Path) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every .proto under proto/ into `out`."""
    from grpc_tools import protoc

    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *[str(p.relative_to(PROTO_DIR)) for p in proto_files()]]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    for pkg in PACKAGES:
        (out / pkg / "__init__.py").touch()
    (out / "stepwire" / "__init__.py").touch()
    return sorted(p.relative_to(out) for p in out.glob("stepwire/**/*") if p.suffix in (".py", ".pyi"))


def differences() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generated = generate(fresh)
        diffs = [str(rel) for rel in generated
                 if not (ROOT / rel).exists() or not filecmp.cmp(fresh / rel, ROOT / rel, shallow=False)]
        # .py and .pyi only: bytecode caches beside them are not committed code.
        committed = {p.relative_to(ROOT) for p in (ROOT / "stepwire").glob("**/*_pb2*") if p.suffix in (".py", ".pyi")}
        diffs += [f"{rel} (no .proto generates it)" for rel in sorted(committed - set(generated))]
        return diffs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check:
        diffs = differences()
        for d in diffs:
            print(f"out of date: {d}")
        sys.exit(1 if diffs else 0)
    for rel in generate(ROOT):
        print(rel)


if __name__ == "__main__":
    main()
