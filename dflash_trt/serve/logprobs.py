"""OpenAI's `logprobs` objects from the runtime's `TokenLogprob`s (`dflash_trt.runtime.logprobs`).

Two shapes, as the OpenAI API reference gives them (and vLLM / trtllm-serve return them):
- Chat Completions (`logprobs: true`, `top_logprobs: 0..20`): `{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}`.
- Completions (`logprobs: 0..20`; OpenAI allows 5, vLLM 20): `{"tokens": [...], "token_logprobs":
  [...], "top_logprobs": [{token: logprob, ...}, ...], "text_offset": [...]}`, where each
  `top_logprobs` entry holds the `logprobs` most likely tokens and the sampled one (up to logprobs + 1
  entries, OpenAI's rule; two ids with the same text share a key).
A token's text is its own decode (special tokens included: "<|im_end|>"); one that holds part of a
multi-byte character reads U+FFFD there and its exact bytes are in `bytes`. `text_offset` counts the
characters of the listed tokens' texts from the start of the completion.
"""

from __future__ import annotations

import functools
from typing import Callable

from dflash_trt.runtime.logprobs import TokenLogprob


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
        tokens = [self.text(t) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": [None if lp is None else {**{self.text(i): v for i, v in lp.top}, tok: lp.logprob}
                                 for tok, lp in zip(tokens, lps)],
                "text_offset": offsets}

    def prompt_text(self, token_ids: list[int]) -> str:
        """A token-id prompt's text for `echo` (special tokens kept: it is what was sent)."""
        with self._lock:
            return self._tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
