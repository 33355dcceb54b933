"""OpenAI's `logprobs` objects from the runtime's `TokenLogprob`s (`dflash_trt.runtime.logprobs`).

Two shapes, as the OpenAI API reference gives them (and vLLM / trtllm-serve return them):
- Chat Completions (`logprobs: true`, `top_logprobs: 0..20`): `{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}`.
- Completions (`logprobs: 0..20`; OpenAI allows 5, vLLM 20): `{"tokens": [...], "token_logprobs":
  [...], "top_logprobs": [{token: logprob, ...}, ...], "text_offset": [...]}`, where each
  `top_logprobs` entry holds the `logprobs` most likely tokens and the sampled one (up to logprobs + 1
  entries, OpenAI's rule).
A token's text is its own decode (special tokens included: "<|im_end|>"). One that holds part of a
multi-byte character has no text of its own: in Chat Completions its `token` reads U+FFFD there and its
exact bytes are in `bytes`; Completions, which has no `bytes`, names it by its bytes, "bytes:\\xf0\\x9f"
(OpenAI's legacy form), so distinct partial tokens stay distinct `top_logprobs` keys. `text_offset` is the
character where each token's text starts (the characters its predecessors' bytes complete), counted from
the start of the completion (of the prompt with `echo`), so `text[offset:]` starts at the token's
character: a token that completes a character begun by earlier tokens starts there too.
"""

from __future__ import annotations

import codecs
import functools
from typing import Callable

from dflash_trt.runtime.logprobs import TokenLogprob


def _continues(pending: bytes, byte: bytes) -> bool:
    """Whether `byte` is a valid next byte of the incomplete UTF-8 character `pending` begins."""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(pending + byte, final=False)
    except UnicodeDecodeError:
        return False
    return True


class LogprobFormatter:
    """Formats logprobs for one tokenizer, caching each token's text and bytes.

    Args:
        tokenizer: the target's Hugging Face tokenizer.
        lock: a context manager held around every tokenizer call (the server's tokenizer lock), or None.
    """

    def __init__(self, tokenizer, lock=None):
        from contextlib import nullcontext

        self._tokenizer, self._lock = tokenizer, lock if lock is not None else nullcontext()
        self.text: Callable[[int], str] = functools.lru_cache(maxsize=65536)(self._text)
        self.bytes: Callable[[int], list[int]] = functools.lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        with self._lock:
            return self._tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _bytes(self, token_id: int) -> list[int]:
        from dflash_trt.text import token_bytes

        with self._lock:
            return list(token_bytes(self._tokenizer, token_id))

    def completion_token(self, token_id: int) -> str:
        """A token's string in Completions' `tokens` and `top_logprobs` keys: its text, or, where its bytes
        are not whole UTF-8 characters, "bytes:" and each byte as a \\xNN escape."""
        data = bytes(self.bytes(token_id))
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
        return self.text(token_id)

    def characters(self, token_ids: list[int]) -> int:
        """The characters the tokens' bytes, concatenated, make complete (a trailing part of one is not
        counted; invalid bytes count one each, as U+FFFD)."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        return sum(len(decoder.decode(bytes(self.bytes(t)))) for t in token_ids)

    def chat(self, logprobs: list[TokenLogprob]) -> dict:
        """The Chat Completions `logprobs` object (or the part of it a stream chunk carries)."""

        def entry(token_id: int, logprob: float) -> dict:
            return {"token": self.text(token_id), "logprob": logprob, "bytes": self.bytes(token_id)}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for lp in logprobs], "refusal": None}

    def completion(self, logprobs: list[TokenLogprob], offset: int = 0,
                   prompt: tuple[list[int], list[TokenLogprob | None]] | None = None) -> dict:
        """The Completions `logprobs` object; `offset`: the characters before these tokens (a stream's
        earlier chunks), where `text_offset` starts. `prompt` (`echo`): (prompt token ids, their
        `prompt_logprobs`), listed first; the first prompt token's logprob and top_logprobs are null
        (nothing predicts it), as OpenAI's and vLLM's echo give them."""
        ids, lps = [], []
        if prompt is not None:
            ids, lps = list(prompt[0]), list(prompt[1])
        ids += [lp.token_id for lp in logprobs]
        lps += logprobs
        tokens = [self.completion_token(t) for t in ids]
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        offsets = []
        for t in ids:
            data = bytes(self.bytes(t))
            pending = decoder.getstate()[0]  # earlier tokens' bytes of a character not complete yet
            # a token that completes that character starts at it; one that does not continue it starts after
            # the U+FFFD those bytes then become
            offsets.append(offset + (len(pending.decode("utf-8", "replace"))
                                     if pending and data and not _continues(pending, data[:1]) else 0))
            offset += len(decoder.decode(data))
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": [None if lp is None
                                 else {**{self.completion_token(i): v for i, v in lp.top}, tok: lp.logprob}
                                 for tok, lp in zip(tokens, lps)],
                "text_offset": offsets}

    def prompt_text(self, token_ids: list[int]) -> str:
        """A token-id prompt's text for `echo` (special tokens kept: it is what was sent)."""
        with self._lock:
            return self._tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
