"""Integer arithmetic the engine repeats: blocks needed for a token count and the like."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for integers (b > 0): e.g. the blocks of b tokens that hold a tokens."""
    return -(-a // b)
