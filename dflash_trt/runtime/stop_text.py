"""Stop strings: incremental detokenization of one completion that ends at the first stop string (OpenAI's
`stop`, vLLM's and TensorRT-LLM's `SamplingParams.stop`).

`Engine` checks a request's `SamplingParams.stop` with it as tokens are emitted (the output ends with the token
that completes the string); the server (`dflash_trt.serve`) and the Triton model also stream each completion's
text through it, holding back a tail that could still become a stop string.
"""

from __future__ import annotations

from typing import Callable

from dflash_trt.text import final_text, partial_suffix, text_to_stream


class StopText:
    """Incremental detokenization of one completion with OpenAI stop strings.

    `add(ids)` appends token ids and returns "stop" once a stop string appears in the text's complete
    characters (the text is then cut before it, as OpenAI returns it); `delta()` gives the text not sent
    yet that is safe to send: complete characters (`text_to_stream`) and no tail that could still become a
    stop string. With `min_tokens`, only a stop string completed by a later token counts, as only a later token
    can be a stop token (vLLM's idea; vLLM itself lets the min_tokens-th token complete a stop string, one
    token earlier): one that ends within the first min_tokens tokens' text is text.

    Decoding is incremental (vLLM's prefix and read offsets): a step decodes the tokens after a committed point
    (at most ~2 LAG + WINDOW of them), not the whole output, so its cost does not grow with the output's length
    (8,192 tokens of SmolLM2 3 per step: 846 -> 24 us a step, `build_scripts/bench_detokenize.py`). The text is
    `decode(ids)`'s at every step: where a tokenizer's text of the last tokens before the committed point changes
    with what follows (clean_up_tokenization_spaces' " ." -> "."), that step decodes the whole output instead.

    Args:
        decode: token ids -> text (the tokenizer's decode, special tokens skipped).
        stops: stop strings (non-empty).
        token_aligned: `delta()` also ends at a token boundary (the text of a whole number of tokens): a
            streamed chunk then carries exactly its tokens' text, where their logprobs go with it (a token
            holding a character and part of the next one waits until that one is whole).
        min_tokens: the request's `SamplingParams.min_tokens`.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = (), token_aligned: bool = False,
                 min_tokens: int = 0):
        self.decode, self.stops, self.token_aligned, self.min_tokens = decode, stops, token_aligned, min_tokens
        self._floor = 0  # characters of the first min_tokens tokens' whole text: a stop string must end past them
        self.ids: list[int] = []
        self.text = ""
        self.sent = ""
        self.stopped = False
        self.used: int | None = None  # tokens up to the one that completed the stop string
        self.matched: str | None = None  # that stop string (vLLM's and TensorRT-LLM's stop_reason)
        self._aligned = 0  # token_aligned: the tokens whose text `sent` holds
        # incremental detokenization: ids[:_k0] decode to _text0, which ends on a whole character; later text is
        # decoded from a few tokens before _k0 on (_head is those tokens' text), so a step decodes a bounded tail,
        # not the whole output (vLLM's prefix/read offsets)
        self._k0, self._text0, self._head = 0, "", ""

    def add(self, ids: list[int]) -> str | None:
        if self.stopped or not ids:
            return None
        before = len(self.ids)
        self.ids.extend(ids)
        text = self._prefix(len(self.ids))
        self._commit()
        if len(self.ids) <= self.min_tokens:
            self.text = text
            return None
        if 0 < self.min_tokens and before <= self.min_tokens:  # these ids pass min_tokens: no stop ends before here
            self._floor = len(self.decode(self.ids[: self.min_tokens]).rstrip("\ufffd"))
        if self._find(text) < 0:
            self.text = text
            return None
        # several tokens may come at once (accepted drafts): count those up to the first one that completes a
        # stop string, and cut the text there, as if they had come one at a time (a stop string starting earlier
        # but completed by a later token, "abcdef" beside "cd", does not count)
        self.used = next((k for k in range(max(before, self.min_tokens) + 1, len(self.ids))
                          if self._find(self._prefix(k)) >= 0), len(self.ids))
        whole = text if self.used == len(self.ids) else self._prefix(self.used)
        cut = self._find(whole)
        self.text, self.stopped = whole[:cut], True
        # the one found there; of two starting at the same character, the shorter (it completed first)
        self.matched = min((s for s in self.stops if whole.startswith(s, cut)), key=len)
        return "stop"

    WINDOW = 6  # tokens decoded before the committed point, for tokenizers whose text of a token depends on the last
    LAG = 32  # tokens kept after the committed point (held-back text and a stop string's cut are decoded from it)

    def _prefix(self, k: int) -> str:
        """The text of the first `k` ids, as `decode(ids[:k])` gives it, decoding only the ids after the committed
        point (and WINDOW before it). Where a tokenizer's text of those ids does not begin with the window's own
        text (a tokenizer that rewrites earlier text later), the whole prefix is decoded instead."""
        if k < self._k0 or self._k0 == 0:
            return self.decode(self.ids[:k])
        tail = self.decode(self.ids[max(0, self._k0 - self.WINDOW) : k])
        if not tail.startswith(self._head):
            return self.decode(self.ids[:k])
        return self._text0 + tail[len(self._head) :]

    def _commit(self) -> None:
        """Move the committed point to LAG tokens before the end once it is 2 LAG behind, where the text there
        ends on a whole character (a byte-level piece of a character waits for the rest)."""
        point = len(self.ids) - self.LAG
        if point - self._k0 < self.LAG:
            return
        text = self._prefix(point)
        if text.endswith("\ufffd"):
            return
        self._k0, self._text0 = point, text
        self._head = self.decode(self.ids[max(0, point - self.WINDOW) : point])

    @property
    def generated(self) -> int:
        """Tokens received so far, up to the one that completed a stop string once stopped (what
        `usage.completion_tokens` counts)."""
        return len(self.ids) if self.used is None else self.used

    def _find(self, text: str) -> int:
        """Where the first stop string starts in `text`'s complete characters, or -1; one that ends within the
        first min_tokens tokens' text does not count. A trailing run of U+FFFD is not searched: it is a character
        whose remaining bytes come in later tokens (`text_to_stream` holds it back too), so a stop string cannot
        match half of one, streamed or not."""
        whole = text[: len(text.rstrip("\ufffd"))]
        starts = (whole.find(s, max(0, len(self.sent) - len(s), self._floor - len(s) + 1)) for s in self.stops)
        return min((k for k in starts if k >= 0), default=-1)

    def _held(self) -> int:
        """Characters at the end of the text's complete characters (a trailing U+FFFD, a character still
        being decoded, left out as `text_to_stream` leaves it out) that are a proper prefix of a stop string."""
        return partial_suffix(self.text[: len(self.text.rstrip("\ufffd"))], self.stops)

    def delta(self) -> str:
        """New text to send; afterwards it counts as sent."""
        new = text_to_stream(self.text, self.sent)
        if not self.stopped:
            new = new[: max(0, len(new) - self._held())]
        if self.token_aligned and new:
            shown = self.sent + new
            k, aligned = self._tokens_within(shown, self.generated, self._aligned)
            new = aligned[len(self.sent):] if len(aligned) > len(self.sent) and aligned.startswith(self.sent) else ""
            self._aligned = k
        self.sent += new
        return new

    def _tokens_within(self, shown: str, n: int, lo: int) -> tuple[int, str]:
        """The longest prefix of the first `n` ids (at least `lo`) whose text is whole (no trailing part of
        a character) and within `shown`: (its length, its text; "" when it is `lo`, not decoded)."""
        if not self.stopped and n == len(self.ids) and shown == self.text and not self.text.endswith("\ufffd"):
            return n, self.text
        for k in range(n, lo, -1):
            text = self._prefix(k)
            if not text.endswith("\ufffd") and shown.startswith(text):
                return k, text
        return lo, ""

    def sent_tokens(self, lo: int = 0) -> int:
        """How many of the ids received (up to the stop string's last, once stopped) have their whole text
        in what `delta` sent: the longest such prefix, at least `lo` (a count found before). A token whose
        text is held back (part of a character, the start of a possible stop string) is not counted yet.
        With `token_aligned`, `delta` found it already."""
        if self.token_aligned:
            return max(self._aligned, lo)
        return max(self._tokens_within(self.sent, self.generated, lo)[0], lo)

    def rest(self, finish_reason: str | None) -> str:
        """The final text's part not sent yet (at the end of generation; `final_text` drops a trailing
        half character of a length-cut completion)."""
        final = final_text(self.text, finish_reason)
        new = final[len(self.sent):] if final.startswith(self.sent) else ""
        self.sent += new
        return new
