"""Automatic prefix caching: the K/V of token sequences the runtime has already read, kept after their
requests end, so a new prompt that starts with one of them skips prefilling that part.

What vLLM calls automatic prefix caching (`--enable-prefix-caching`) and TensorRT-LLM KV cache block reuse
(`kv_cache_config.enable_block_reuse`): a multi-turn conversation's next prompt repeats the previous prompt and
answer, and requests often share a system prompt. For DFlash both caches are kept: the target's K/V and the
drafter's injected context K/V (paper sec. 3.2) of the same positions, so drafting after a cached prefix sees the
same context as after a full prefill.

An entry is one sequence: its tokens and the K/V of all of them ([2, layers, kv_heads, n, head_dim] per cache,
`KVCache.export_row`). A prompt reuses the longest prefix it shares with an entry, at most all of its tokens but
the last (whose logits choose the first token, so it is always read). Entries are whole sequences, not blocks:
two conversations sharing a system prompt hold two copies of it. Entries are dropped least recently used first
when their bytes pass `max_bytes`; one that is a prefix of a newer one is dropped when that one is stored.

The reused K/V were computed in another forward pass (of other shapes: the earlier request's prefill or verify
steps), so as with chunked prefill a reused prefix may change logits in their last bits, and greedy tokens only
where two are that close.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch


@dataclass
class PrefixEntry:
    """One cached sequence: `tokens` (n ids), the target's K/V of them and (DFlash) the drafter's context K/V,
    each [2 (k, v), layers, kv_heads, n, head_dim] in the cache's dtype and device; `drafter` None for a
    sequence read without a drafter (mode "ar"): it serves mode "ar" only."""

    tokens: torch.Tensor  # [n] int64, on the CPU
    target: torch.Tensor
    drafter: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        kv = [t for t in (self.target, self.drafter) if t is not None]
        return sum(t.numel() * t.element_size() for t in kv)


class PrefixCache:
    """The K/V of recently read token sequences, for prompts that start with one (see the module docstring).

    Args:
        max_bytes: bytes of K/V kept at most (both caches; an entry larger than this is not kept).
    Raises:
        ValueError: max_bytes < 1.
    Attributes:
        queried_tokens / hit_tokens: prompt tokens looked up / reused, over every `record` call (vLLM's
            prefix cache queries and hits; hit rate = hit_tokens / queried_tokens).
    """

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a whole number of bytes >= 1, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[int, PrefixEntry] = collections.OrderedDict()  # oldest use first
        self._next = 0
        self.nbytes = 0
        self.queried_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: list[int], with_drafter: bool) -> tuple[int, PrefixEntry | None]:
        """The longest prefix of `prompt` held by an entry, capped at len(prompt) - 1 tokens, and that entry
        (marked as just used); (0, None) when none shares a token. `with_drafter`: only entries holding the
        drafter's context too (mode "dflash")."""
        if len(prompt) < 2:
            return 0, None
        ids = torch.tensor(prompt[:-1], dtype=torch.int64)
        best, found = 0, None
        for key, e in self._entries.items():
            if with_drafter and e.drafter is None:
                continue
            n = min(len(ids), len(e.tokens))
            if n <= best:
                continue
            diff = torch.nonzero(ids[:n] != e.tokens[:n])
            shared = int(diff[0, 0]) if len(diff) else n
            if shared > best:
                best, found = shared, key
        if found is None:
            return 0, None
        self._entries.move_to_end(found)
        return best, self._entries[found]

    def record(self, queried: int, hit: int) -> None:
        """Count a prompt of `queried` tokens, `hit` of them reused."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    def store(self, tokens: list[int], target: torch.Tensor, drafter: torch.Tensor | None) -> bool:
        """Keep the K/V of `tokens` (target / drafter: [2, layers, kv_heads, len(tokens), head_dim], copies the
        cache will not write again). Entries that are prefixes of `tokens` (and hold no drafter context it
        lacks) are dropped; nothing is stored when an entry already holds `tokens` as a prefix, or when the
        entry alone would pass max_bytes. Then the least recently used entries go until the bytes fit.

        Returns:
            whether it was stored.
        Raises:
            ValueError: K/V whose length is not len(tokens)."""
        n = len(tokens)
        for kv in (target, drafter):
            if kv is not None and (kv.dim() != 5 or kv.shape[3] != n):
                raise ValueError(f"K/V of shape {tuple(kv.shape)} for {n} tokens: want [2, layers, kv_heads, {n}, "
                                 "head_dim]")
        if not n:
            return False
        ids = torch.tensor(tokens, dtype=torch.int64)
        entry = PrefixEntry(ids, target, drafter)
        if entry.nbytes > self.max_bytes:
            return False
        for key, e in list(self._entries.items()):
            m = min(n, len(e.tokens))
            if not torch.equal(ids[:m], e.tokens[:m]):
                continue
            if len(e.tokens) >= n and (e.drafter is not None or drafter is None):
                self._entries.move_to_end(key)  # already held
                return False
            if len(e.tokens) <= n and (drafter is not None or e.drafter is None):
                self._drop(key)
        self._entries[self._next] = entry
        self._next += 1
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes

    def clear(self) -> None:
        """Drop every entry (the counters stay)."""
        self._entries.clear()
        self.nbytes = 0
