"""Range checks shared by ``CompressionConfig`` and the methods' own parameters.

Every check raises :class:`ValueError` naming the field, the value and the valid range,
so a misconfigured engine fails at start-up instead of mid-generation.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn


def fail(field: str, value: object, valid: str) -> NoReturn:
    raise ValueError(f"{field}={value!r} is invalid: {valid}")


def check_int(field: str, value: Any, lo: int, hi: int | None = None) -> None:
    """``value`` is an integer (not a bool) in ``[lo, hi]``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo
    if ok and (hi is None or value <= hi):
        return
    fail(field, value, f"must be an integer in [{lo}, {'inf' if hi is None else hi}]")


def check_number(field: str, value: Any, lo: float, hi: float, valid: str, *, lo_open: bool = False) -> None:
    """``value`` is a real number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        fail(field, value, valid)
    if value < lo or (lo_open and value == lo) or value > hi:
        fail(field, value, valid)


def check_choice(field: str, value: Any, choices: tuple[str, ...] | list[str]) -> None:
    if value not in choices:
        fail(field, value, f"must be one of {', '.join(choices)}")
