"""Prompt lookup: draft candidates copied from a request's own context (n-gram matching).

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; Hugging Face `generate(...,
prompt_lookup_num_tokens=...)`, vLLM's "ngram" speculator, TensorRT-LLM's NGram decoding) drafts
the tokens that followed the most recent earlier occurrence of the context's last n tokens. It
costs no model pass and is strong wherever the output repeats its input: code that restates the
signature and docstring it was given, edits, quotes, lists.

In dflash-trt it is not a decoder of its own: its candidate continuation joins the DFlash draft
tree as one more branch (`dflash_trt.runtime.draft_tree.add_path`), so the target verifies the
drafter's candidates and the copied ones in the same pass and greedy output stays the target's.

Matching follows vLLM's `prompt_lookup_max` / `prompt_lookup_min`: the longest suffix n-gram
(n from max down to min) that occurred before wins, its most recent occurrence.
"""

from __future__ import annotations

#: Defaults: suffix n-grams of 4 down to 3 tokens. With the default SmolLM2 drafter (BENCHMARKS.md,
#: session 12) matches of 1-2 tokens were rarely followed by what the target wrote (19-48% of steps
#: accepted the first copied token, and only 9-27% past what the drafter's own tree accepted), so
#: verifying them cost more than they gained on a CPU; matches of 3 or more: 62-94%.
PROMPT_LOOKUP_MAX = 4
PROMPT_LOOKUP_MIN = 3


class NgramIndex:
    """The token history of one request with, for each n in [min_n, max_n], where every n-gram
    occurred last with at least one token after it. Appending a token costs O(max_n); a lookup
    O(max_n + num_tokens), independent of the history's length.

    Args:
        tokens: the initial history (the prompt's token ids).
        max_n / min_n: the n-gram sizes matched, 1 <= min_n <= max_n.
    Raises:
        ValueError: min_n < 1 or max_n < min_n.
    """

    def __init__(self, tokens: list[int] = (), max_n: int = PROMPT_LOOKUP_MAX, min_n: int = PROMPT_LOOKUP_MIN):
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        # n -> {n-gram: index of the token after its latest occurrence}
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens to the history."""
        toks = self.tokens
        for tok in tokens:
            end = len(toks)  # the n-grams ending at end - 1 now have a continuation: tok
            for n, table in self.after.items():
                if end >= n:
                    table[tuple(toks[end - n : end])] = end
            toks.append(tok)

    def lookup(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed the latest earlier occurrence of the history's
        longest matching suffix n-gram (n from max_n down to min_n), or [] when none occurred."""
        toks = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(toks) <= n:
                continue
            at = self.after[n].get(tuple(toks[-n:]))
            if at is not None:
                return toks[at : at + num_tokens]
        return []
