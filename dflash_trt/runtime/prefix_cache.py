"""Automatic prefix caching: the K/V of token sequences the runtime has already read, kept after their
requests end in a radix tree, so a new prompt that starts with one of them skips prefilling that part.

What vLLM calls automatic prefix caching (`--enable-prefix-caching`), SGLang RadixAttention and TensorRT-LLM KV
cache block reuse (`kv_cache_config.enable_block_reuse`): a multi-turn conversation's next prompt repeats the
previous prompt and answer, and requests often share a system prompt or few-shot examples. For DFlash both caches
are kept: the target's K/V and the drafter's injected context K/V (paper sec. 3.2) of the same positions, so
drafting after a cached prefix sees the same context as after a full prefill.

The tree (SGLang's radix tree, at token granularity rather than vLLM's / TensorRT-LLM's fixed blocks): each node
holds a run of tokens and the K/V of those positions ([2, layers, kv_heads, run, head_dim] per cache, slices of
`KVCache.read_row`); a node's path from the root is the sequence its K/V continue. Sequences that share a prefix
share its nodes, so conversations with one system prompt hold it once; storing a sequence that diverges inside a
node splits the node there. A prompt reuses the longest prefix the tree holds, at most all of its tokens but the
last (whose logits choose the first token, so it is always read). When the bytes pass `max_bytes`, the least
recently used leaves are dropped first (a node goes only after every sequence continuing it).

The drafter's context is optional per node: a sequence read without a drafter (mode "ar") stores the target's K/V
only, and serves mode "ar" only; a DFlash sequence over the same tokens adds the drafter's part. Nodes holding the
drafter's context always form a prefix of their paths (storing a DFlash sequence completes its whole path).

Every position's K/V depends only on the tokens up to it, but the reused K/V were computed in another forward
pass (of other shapes: the earlier request's prefill or verify steps), so as with chunked prefill a reused prefix
may change logits in their last bits, and greedy tokens only where two are that close.
"""

from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass, field

import torch


#: the least bound a user may give the cache, in GiB (about 1 MiB; `--prefix-cache-gb`, Triton's `prefix_cache_gb`):
#: below it the cache holds a few tokens' K/V at most (one token of the default model is 45 KiB in float32, of a 70B
#: target 320 KiB in bfloat16), so no prompt would be reused
MIN_PREFIX_CACHE_GB = 0.001


@dataclass
class PrefixEntry:
    """A cached prefix, as `PrefixCache.match` returns it: `tokens` (n ids), and the target's K/V of them and
    (DFlash) the drafter's context K/V as the parts the tree's nodes hold, each [2 (k, v), layers, kv_heads, m,
    head_dim] in the cache's dtype and device, consecutive in the token axis (m summing to n): views of the
    nodes' tensors, which `KVCache.import_row` writes to a cache row as they are (joining them first copied the
    whole prefix once more). `drafter_parts` None for a match asked without it (mode "ar"). Read the parts
    before the tree is changed again; `target` / `drafter` join them into one tensor (a copy)."""

    tokens: torch.Tensor  # [n] int64, on the CPU
    target_parts: tuple[torch.Tensor, ...]
    drafter_parts: tuple[torch.Tensor, ...] | None

    @property
    def target(self) -> torch.Tensor:
        """The target's K/V of the prefix, [2, layers, kv_heads, n, head_dim] (a copy)."""
        return torch.cat(self.target_parts, dim=3)

    @property
    def drafter(self) -> torch.Tensor | None:
        """The drafter's context K/V of the prefix, [2, layers, kv_heads, n, head_dim] (a copy), or None."""
        return None if self.drafter_parts is None else torch.cat(self.drafter_parts, dim=3)


@dataclass(eq=False)
class _Node:
    """A radix tree node: a run of tokens (after its parent's path) and their K/V, [2, layers, kv_heads,
    len(tokens), head_dim] each (`drafter` None where only the target's are held; the root holds none). Parents
    hold their children; a child refers to its parent weakly, so a dropped subtree is freed at once."""

    tokens: tuple[int, ...]
    target: torch.Tensor | None
    drafter: torch.Tensor | None
    parent_ref: weakref.ref | None
    children: dict[int, _Node] = field(default_factory=dict)  # by their first token
    last_use: int = 0

    @property
    def parent(self) -> _Node | None:
        return None if self.parent_ref is None else self.parent_ref()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.target, self.drafter) if t is not None)


def _per_token(kv: torch.Tensor | None) -> int:
    """Bytes a token's K/V take in `kv` ([2, layers, kv_heads, n, head_dim]); 0 for None."""
    return 0 if kv is None else kv.numel() // max(kv.shape[3], 1) * kv.element_size()


def common_prefix_length(a, b) -> int:
    """How many leading tokens two token id sequences (lists or tuples of ints) share: a bisection over slice
    comparisons (each one C-level), O(n log n) element compares at worst."""
    n = min(len(a), len(b))
    a, b = tuple(a[:n]), tuple(b[:n])
    if a == b:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


def _shared(run: tuple[int, ...], ids: list[int], start: int) -> int:
    """How many leading tokens of `run` equal ids[start:]."""
    return common_prefix_length(run, ids[start : start + len(run)])


class PrefixCache:
    """The K/V of recently read token sequences, in a radix tree, for prompts that start with one (see the module
    docstring).

    Args:
        max_bytes: bytes of K/V kept at most (both caches; of a sequence whose K/V alone pass it, the longest
            prefix that fits is kept).
    Raises:
        ValueError: max_bytes < 1.
    Attributes:
        nbytes: bytes of K/V held now (each shared prefix counted once).
        queried_tokens / hit_tokens: prompt tokens looked up / reused, over every `record` call (vLLM's
            prefix cache queries and hits; hit rate = hit_tokens / queried_tokens).
    """

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a whole number of bytes >= 1, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._root = _Node((), None, None, None)
        self._clock = 0
        self.nbytes = 0
        self.queried_tokens = 0
        self.hit_tokens = 0

    def _nodes(self) -> list[_Node]:
        """Every node but the root, parents before their children."""
        out, todo = [], list(self._root.children.values())
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(node.children.values())
        return out

    def __len__(self) -> int:
        """The number of sequences held that no other held sequence continues (the tree's leaves)."""
        return sum(not node.children for node in self._nodes())

    @property
    def held_tokens(self) -> int:
        """Token positions whose K/V are held (each shared prefix counted once)."""
        return sum(len(node.tokens) for node in self._nodes())

    def sequences(self) -> list[list[int]]:
        """The token ids of each sequence `len` counts (root to leaf), least recently used first."""
        leaves = sorted((n for n in self._nodes() if not n.children), key=lambda n: n.last_use)
        out = []
        for node in leaves:
            runs = []
            while node is not self._root:
                runs.append(node.tokens)
                node = node.parent
            out.append([t for run in reversed(runs) for t in run])
        return out

    def _touch(self, path: list[_Node]) -> None:
        self._clock += 1
        for node in path:
            node.last_use = self._clock

    def match(self, prompt: list[int], with_drafter: bool) -> tuple[int, PrefixEntry | None]:
        """The longest prefix of `prompt` the tree holds, capped at len(prompt) - 1 tokens, as a `PrefixEntry` of
        exactly those tokens (its nodes marked as just used); (0, None) when none is held. `with_drafter`: only
        what holds the drafter's context too (mode "dflash"), and the entry carries it."""
        ids = [int(t) for t in prompt[:-1]]  # ints: a tensor's elements would not find the children's keys
        node, pos, parts = self._root, 0, []
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None or (with_drafter and child.drafter is None):
                break
            k = _shared(child.tokens, ids, pos)
            parts.append((child, k))
            pos += k
            if k < len(child.tokens):
                break
            node = child
        if not pos:
            return 0, None
        self._touch([n for n, _ in parts])
        target = tuple(n.target[:, :, :, :k] for n, k in parts)
        drafter = tuple(n.drafter[:, :, :, :k] for n, k in parts) if with_drafter else None
        return pos, PrefixEntry(torch.tensor(ids[:pos], dtype=torch.int64), target, drafter)

    def record(self, queried: int, hit: int) -> None:
        """Count a prompt of `queried` tokens, `hit` of them reused."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    def _split(self, node: _Node, k: int) -> None:
        """Cut `node`'s run after k tokens (0 < k < its length): it keeps the first k, a new child the rest (with
        its children). Copies, so that dropping either part frees its bytes."""
        rest = _Node(node.tokens[k:], node.target[:, :, :, k:].clone(),
                     None if node.drafter is None else node.drafter[:, :, :, k:].clone(), weakref.ref(node),
                     node.children, node.last_use)
        for child in rest.children.values():
            child.parent_ref = weakref.ref(rest)
        node.tokens, node.children = node.tokens[:k], {rest.tokens[0]: rest}
        node.target = node.target[:, :, :, :k].clone()
        if node.drafter is not None:
            node.drafter = node.drafter[:, :, :, :k].clone()

    def store(self, tokens: list[int], target: torch.Tensor, drafter: torch.Tensor | None) -> bool:
        """Keep the K/V of `tokens` (target / drafter: [2, layers, kv_heads, len(tokens), head_dim], views of a
        cache row (`KVCache.read_row`) or any tensors: the tree copies the parts it keeps, only those): the part of its path the tree lacks is added (the drafter's context filled
        in where only the target's was held); what it already holds is kept as it is. Where the nodes that would
        hold it (with what they hold already) pass max_bytes, its longest prefix that fits is stored instead (a
        long conversation keeps its start: the system prompt, the first turns). Then the least recently used
        leaves are dropped until the bytes fit (never this sequence's path).

        Returns:
            whether anything was added (False: all of it held already, or not even its first token fits).
        Raises:
            ValueError: K/V whose length is not len(tokens)."""
        n = len(tokens)
        for kv in (target, drafter):
            if kv is not None and (kv.dim() != 5 or kv.shape[3] != n):
                raise ValueError(f"K/V of shape {tuple(kv.shape)} for {n} tokens: want [2, layers, kv_heads, {n}, "
                                 "head_dim]")
        ids = [int(t) for t in tokens]
        if n and self._path_bytes(ids, target, drafter) > self.max_bytes:  # keep the longest prefix that fits
            lo, hi = 0, n - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self._path_bytes(ids[:mid], target, drafter) <= self.max_bytes else (lo, mid - 1)
            n, ids = lo, ids[:lo]
            target = target[:, :, :, :n]
            drafter = None if drafter is None else drafter[:, :, :, :n]
        if not n:
            return False
        node, pos, path, added = self._root, 0, [], False
        while pos < n:
            child = node.children.get(ids[pos])
            if child is None:  # the rest is new
                child = _Node(tuple(ids[pos:]), target[:, :, :, pos:].clone(),
                              None if drafter is None else drafter[:, :, :, pos:].clone(), weakref.ref(node))
                node.children[ids[pos]] = child
                self.nbytes += child.nbytes
                path.append(child)
                added = True
                break
            k = _shared(child.tokens, ids, pos)
            if k < len(child.tokens) and (pos + k < n or (drafter is not None and child.drafter is None)):
                self._split(child, k)  # diverges inside it, or ends inside it and fills in the drafter's part
            if drafter is not None and child.drafter is None:
                child.drafter = drafter[:, :, :, pos:pos + k].clone()
                self.nbytes += child.drafter.numel() * child.drafter.element_size()
                added = True
            path.append(child)
            pos += k
            node = child
        self._touch(path)
        if self.nbytes > self.max_bytes:
            self._evict(set(path))
        return added

    def _path_bytes(self, ids: list[int], target: torch.Tensor, drafter: torch.Tensor | None) -> int:
        """The bytes of the nodes that will hold `ids` once stored (what must stay for it to be kept): each token's
        target K/V, and its drafter's where `drafter` is given or a node on the path holds them already; a node the
        sequence ends inside, unsplit, counted whole."""
        node, pos, total, n = self._root, 0, 0, len(ids)
        while pos < n:
            child = node.children.get(ids[pos])
            if child is None:
                return total + (n - pos) * (_per_token(target) + _per_token(drafter))
            k = _shared(child.tokens, ids, pos)
            split = k < len(child.tokens) and (pos + k < n or (drafter is not None and child.drafter is None))
            kept = k if split else len(child.tokens)
            total += kept * (_per_token(child.target) + _per_token(child.drafter if child.drafter is not None
                                                                    else drafter))
            pos += k
            if k < len(child.tokens):  # diverges inside it (the rest is new) or ends there
                return total + (n - pos) * (_per_token(target) + _per_token(drafter))
            node = child
        return total

    def _evict(self, keep: set[_Node]) -> None:
        """Drop least recently used leaves (a parent left without children becomes one) until the bytes fit,
        never a node of `keep` (the path just stored, which fits alone: `_path_bytes`)."""
        heap = [(n.last_use, id(n), n) for n in self._nodes() if not n.children and n not in keep]
        heapq.heapify(heap)
        while self.nbytes > self.max_bytes and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            self.nbytes -= leaf.nbytes
            if parent is not self._root and not parent.children and parent not in keep:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))

    def clear(self) -> None:
        """Drop every sequence (the counters stay)."""
        self._root.children.clear()
        self.nbytes = 0
