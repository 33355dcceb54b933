"""Wording helpers for messages and reports."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun, singular for exactly 1: count(1, "warning") == "1 warning",
    count(0, "warning") == "0 warnings", count(2, "KV head") == "2 KV heads"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def invalid_unicode(text: str, from_argv: bool = False) -> str | None:
    """Why `text` is not valid Unicode text that a tokenizer can take, or None when it is: a lone surrogate
    code point (U+D800-U+DFFF), e.g. from a JSON escape such as "\\ud800". `from_argv`: `text` is a
    command-line argument, where Python keeps a byte B that is not UTF-8 as U+DC00 + B (PEP 383), and
    such a code point is named as that byte."""
    try:
        text.encode("utf-8")  # fails exactly at a surrogate (a str holds no other unencodable code point)
        return None
    except UnicodeEncodeError as exc:
        i, ch = exc.start, text[exc.start]
    if from_argv and "\udc80" <= ch <= "\udcff":
        return f"a byte that is not UTF-8 (0x{ord(ch) - 0xDC00:02x}) at character {i + 1}"
    return f"an unpaired surrogate (U+{ord(ch):04X}) at character {i + 1}, which is not a character"
