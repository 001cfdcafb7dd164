"""The widths of the wire's number fields, and checks that a value fits its field.

A value that does not fit its proto field makes the protobuf runtime raise deep inside a conversion,
far from the request that carried it (before these checks existed, a seed of -1 left the client waiting
for ever). Checked at the edge it becomes an error that names the field. Floats must also be finite:
NaN compares false with every bound, so a range check alone lets it through.
"""

from __future__ import annotations

import math
import re

from stepwire.contract.errors import InvalidRequestError

UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38   # a larger double becomes inf in a proto `float`
# A LoRA adapter's name, as the scheduler registers it and the gateway recognises one before asking.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


def integer(field: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(field, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidRequestError(field, f"must be in [{lo}, {hi}], got {value}")
    return value


def real(field: str, value, lo: float, hi: float, *, above: bool = False) -> float:
    """A finite number in [lo, hi], or in (lo, hi] when `above`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(field, f"must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise InvalidRequestError(field, f"must be a finite number, got {value}")
    if value > hi or value < lo or (above and value == lo):
        raise InvalidRequestError(field, f"must be in {'(' if above else '['}{lo:g}, {hi:g}], got {value:g}")
    return value
