"""Opening a GGUF file and reading its metadata, failing with messages a person can act on.

The error type lives here rather than in `convert_gguf` because `python -m tools.convert_gguf` loads that
module a second time as `__main__`: an exception class defined there would exist twice, and the CLI would
not catch the copy raised by the helper modules.
"""

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField

GGUF_MAGIC = b"GGUF"


class ConversionError(Exception):
    """A conversion that cannot go on. The message is one line, written for the person running it."""


def open_gguf(path: Path) -> GGUFReader:
    """A reader over `path`, once the file is known to be a GGUF at all."""
    with path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ConversionError(f"{path} is not a GGUF file (it does not start with the bytes {GGUF_MAGIC!r})")
    try:
        return GGUFReader(path)
    # The reader signals a damaged file with whatever its parsing hits (ValueError, IndexError, struct
    # errors, memory-map errors); to the person running the conversion they all mean the same thing.
    except Exception as exc:
        raise ConversionError(f"{path} is not a readable GGUF file: {exc}") from exc


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value pair of the file as plain Python values (the `GGUF.*` header entries left out)."""
    return {name: _value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _value(field: ReaderField) -> Any:
    value = field.contents()
    if field.types == [GGUFValueType.FLOAT32]:
        # Widened as is, float32 1e-5 reads 9.999999747378752e-06 in config.json; the shortest decimal that
        # rounds to the same float32 is what the model's authors wrote, and it loads as the identical value.
        return float(str(np.float32(value)))
    return value


def require(metadata: dict[str, Any], key: str) -> Any:
    """`metadata[key]`, or a ConversionError naming the key the file lacks."""
    if key not in metadata:
        raise ConversionError(f"the GGUF metadata has no {key!r}, which the conversion needs")
    return metadata[key]
