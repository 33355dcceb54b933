"""Text helpers: wording for messages and reports, incremental detokenization for streaming, and a text that grows
piece by piece (`GrowingText`)."""

from __future__ import annotations

import bisect
import functools
from array import array


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun, singular for exactly 1: count(1, "warning") == "1 warning",
    count(0, "warning") == "0 warnings", count(2, "KV head") == "2 KV heads"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def short_repr(value) -> str:
    """`repr(value)`, cut to 40 characters ("..." ending a longer one): a value named in an error message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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


def partial_suffix(text: str, tags) -> int:
    """The length of the longest end of `text` that is a proper beginning of one of `tags` (strings), 0 if none:
    what a stream holds back while the text may still become a tag (a stop string, `<think>`, `<tool_call>`)."""
    return max((k for tag in tags for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])),
               default=0)


class GrowingText:
    """A text that only grows, kept as the pieces it grew by: `append` costs the piece's length, and `slice(a, b)`
    O(log pieces + (b - a)), so a reader of a streamed answer that takes only what is new since an offset does work
    linear in the answer's length. (A `str` grown by `self.text += piece`, or sliced from an old offset at every
    delta, copies the whole text each time: quadratic, seconds for a 200k-character tool call argument.)

    `str(text)` is the whole text (the pieces are joined once and kept joined until the next `append`: call it at
    the end, not per delta); `len(text)` its length in characters.

    `GrowingText.copied` counts the characters all slices copied, the pieces joined for them included (what reading
    costs: tests check that a stream's readers keep it linear in the text's length).
    """

    copied = 0

    def __init__(self, text: str = ""):
        self._parts: list[str] = []
        self._starts = array("q")  # where each piece starts in the text
        self._len = 0
        self.append(text)

    def append(self, piece: str) -> None:
        """Add `piece` at the end."""
        if piece:
            self._parts.append(piece)
            self._starts.append(self._len)
            self._len += len(piece)

    def __len__(self) -> int:
        return self._len

    def slice(self, a: int, b: int | None = None) -> str:
        """`str(self)[a:b]` for 0 <= a (b None: to the end), joining only the pieces that hold it."""
        b = self._len if b is None else min(b, self._len)
        if a >= b:
            return ""
        i = bisect.bisect_right(self._starts, a) - 1
        j = bisect.bisect_left(self._starts, b, lo=i + 1)
        start = self._starts[i]
        if j == i + 1:
            GrowingText.copied += b - a
            return self._parts[i][a - start:b - start]
        joined = "".join(self._parts[i:j])
        GrowingText.copied += len(joined) + b - a
        return joined[a - start:b - start]

    def __str__(self) -> str:
        if len(self._parts) > 1:
            self._parts, self._starts = ["".join(self._parts)], array("q", [0])
        return self._parts[0] if self._parts else ""


def text_to_stream(text: str, shown: str) -> str:
    """Incremental detokenization: the part of `text` (the decode of every token so far) to print after
    `shown` (printed already, a prefix of an earlier decode). A trailing run of U+FFFD is held back: it
    is a multi-byte character whose remaining bytes come in later tokens, so printing it would garble
    the stream. Returns "" when nothing new is complete or when `text` no longer extends `shown`;
    the caller prints the final text's rest at the end, so the stream equals the final decode."""
    end = len(text.rstrip("\ufffd"))
    if end <= len(shown) or not text.startswith(shown):
        return ""
    return text[len(shown):end]


def final_text(text: str, finish_reason: str | None) -> str:
    """The text to print (and `--json`'s "text") for a completion decoded to `text`: when generation stopped
    for length (--max-tokens, or the target's context filled up), one trailing U+FFFD is dropped: the
    decode of a multi-byte character whose remaining bytes were never generated (one U+FFFD however many of
    its bytes came). Anything else, a U+FFFD inside the text or at the end of a completion that stopped
    on its own (finish_reason "stop"), is the text's own and kept; the token ids stay complete either way.
    A literal U+FFFD that is the very last token of a length-cut completion reads the same and is dropped
    too (the decoded text cannot tell the two apart)."""
    if finish_reason == "length" and text.endswith("\ufffd"):
        return text[:-1]
    return text


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes of one token's text, what OpenAI's logprobs give as `bytes`: exact where a token holds
    part of a multi-byte character, whose `decode([id])` is only U+FFFD. Byte-level BPE pieces (GPT-2,
    Llama 3, Qwen, SmolLM2: each byte stored as one printable character) are mapped back through the
    GPT-2 byte table, SentencePiece byte-fallback pieces (`<0xE2>`) are that byte, and special and added
    tokens, and any other piece, are the UTF-8 of their text ("▁" read as a space).

    Args:
        tokenizer: a Hugging Face tokenizer (fast or slow).
        token_id: an id in its vocabulary.
    """
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return b""
    if int(token_id) in set(getattr(tokenizer, "all_special_ids", ())) or piece in tokenizer.get_added_vocab():
        return piece.encode("utf-8")
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    table = _byte_decoder()
    if all(c in table for c in piece) and _is_byte_level(tokenizer):
        return bytes(table[c] for c in piece)
    return piece.replace("\u2581", " ").encode("utf-8")


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _is_byte_level(tokenizer) -> bool:
    """Whether `tokenizer` stores bytes as GPT-2's printable characters (a ByteLevel pre-tokenizer or decoder)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return "ByteLevel" in repr(backend.pre_tokenizer) or "ByteLevel" in repr(backend.decoder)
