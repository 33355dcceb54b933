"""Wording helpers for messages and reports."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun, singular for exactly 1: count(1, "warning") == "1 warning",
    count(0, "warning") == "0 warnings", count(2, "KV head") == "2 KV heads"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
