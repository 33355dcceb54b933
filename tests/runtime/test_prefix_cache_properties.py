"""The radix-tree prefix cache (`dflash_trt.runtime.prefix_cache`) against a token-level reference, over random
operations (fixed seeds): small alphabets so that sequences share, extend, cut and diverge inside each other's
nodes; autoregressive and DFlash stores mixed; bounds from below one token to 1 GiB.

Each position's K/V is an exact int64 function of (its token prefix, which cache), so every node and every match
can be compared with what was stored for exactly those positions."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_trt.runtime.prefix_cache import PrefixCache

TARGET_HEAD_DIM, DRAFTER_HEAD_DIM = 2, 3  # [2, 1 layer, 1 head, n, head_dim] int64: 32 / 48 bytes a token
TARGET_BYTES, DRAFTER_BYTES = 32, 48


def kv_of(tokens, head_dim: int, salt: int) -> torch.Tensor:
    """[2, 1, 1, n, head_dim]: position p holds hash(salt, tokens[:p + 1]) * 64 + its (k/v, dim) index."""
    base = torch.tensor([hash((salt, *tokens[: p + 1])) & ((1 << 40) - 1) for p in range(len(tokens))],
                        dtype=torch.int64)
    index = torch.arange(2).view(2, 1, 1, 1, 1) * 16 + torch.arange(head_dim).view(1, 1, 1, 1, head_dim)
    return base.view(1, 1, 1, -1, 1) * 64 + index


def target_kv(tokens):
    return kv_of(tokens, TARGET_HEAD_DIM, 1)


def drafter_kv(tokens):
    return kv_of(tokens, DRAFTER_HEAD_DIM, 2)


def nodes_of(pc: PrefixCache) -> list[tuple[object, tuple[int, ...]]]:
    """(node, its path's tokens) of every node, checking the tree's links, keys, lengths and use order."""
    out, todo, seen = [], [(pc._root, ())], set()
    while todo:
        node, path = todo.pop()
        for key, child in node.children.items():
            assert id(child) not in seen and child.tokens and child.tokens[0] == key and child.parent is node
            seen.add(id(child))
            assert child.target.shape[3] == len(child.tokens)
            if child.drafter is not None:  # the drafter's context: only under nodes holding it too
                assert child.drafter.shape[3] == len(child.tokens) and (node is pc._root or node.drafter is not None)
            assert node is pc._root or node.last_use >= child.last_use
            out.append((child, path + child.tokens))
            todo.append((child, path + child.tokens))
    return out


def held(pc: PrefixCache) -> tuple[set, set]:
    """Every token prefix the tree holds the target's K/V of, and those it holds the drafter's context of too."""
    target, drafter = set(), set()
    for node, path in nodes_of(pc):
        for i in range(len(path) - len(node.tokens) + 1, len(path) + 1):
            target.add(path[:i])
            if node.drafter is not None:
                drafter.add(path[:i])
    return target, drafter


def check_tree(pc: PrefixCache, stored: set, stored_with_drafter: set) -> None:
    nodes = nodes_of(pc)
    for node, path in nodes:  # the exact K/V stored for those positions, by a sequence that had them
        start = len(path) - len(node.tokens)
        assert path in stored and torch.equal(node.target, target_kv(path)[:, :, :, start:])
        if node.drafter is not None:
            assert path in stored_with_drafter and torch.equal(node.drafter, drafter_kv(path)[:, :, :, start:])
    assert pc.nbytes == sum(n.nbytes for n, _ in nodes) <= pc.max_bytes
    assert pc.held_tokens == sum(len(n.tokens) for n, _ in nodes)
    leaves = {p: n.last_use for n, p in nodes if not n.children}
    assert len(pc) == len(leaves) and sorted(map(tuple, pc.sequences())) == sorted(leaves)
    uses = [leaves[tuple(s)] for s in pc.sequences()]
    assert uses == sorted(uses)  # least recently used first


def random_sequence(rng: random.Random, pool: list, alphabet: int) -> list[int]:
    if pool and rng.random() < 0.75:
        seq, op = list(rng.choice(pool)), rng.random()
        if op < 0.3:  # ends inside what is held
            return seq[: rng.randint(1, len(seq))]
        if op < 0.6:  # extends it
            return seq + [rng.randrange(alphabet) for _ in range(rng.randint(1, 4))]
        if op < 0.85:  # diverges inside it
            return seq[: rng.randrange(len(seq))] + [rng.randrange(alphabet) for _ in range(rng.randint(1, 4))]
        return seq
    return [rng.randrange(alphabet) for _ in range(rng.randint(1, 10))]


@pytest.mark.parametrize("seeds", [range(0, 15), range(15, 30), range(30, 45)])
def test_random_operations_keep_exactly_what_was_stored(seeds):
    for seed in seeds:
        rng = random.Random(seed)
        alphabet = rng.choice([2, 2, 3, 4, 6])
        per = TARGET_BYTES + DRAFTER_BYTES
        pc = PrefixCache(rng.choice([1, 31, 32, 80, 3 * per, 5 * per + 7, 10 * per, 25 * per, 60 * per, 1 << 30]))
        stored, stored_with_drafter, pool = set(), set(), []
        for _ in range(150):
            r = rng.random()
            seq = random_sequence(rng, pool, alphabet)
            with_drafter = rng.random() < 0.5
            if r < 0.45:
                before_target, before_drafter = held(pc)
                before = before_drafter if with_drafter else before_target

                def path_bytes(m):  # what the path of seq[:m] holds once stored: the drafter's part where given
                    return sum(TARGET_BYTES + (DRAFTER_BYTES if with_drafter or tuple(seq[:j]) in before_drafter
                                               else 0) for j in range(1, m + 1))  # or held already

                fits = max((m for m in range(len(seq) + 1) if path_bytes(m) <= pc.max_bytes), default=0)
                for i in range(1, len(seq) + 1):
                    stored.add(tuple(seq[:i]))
                    if with_drafter:
                        stored_with_drafter.add(tuple(seq[:i]))
                target, drafter = target_kv(seq), drafter_kv(seq) if with_drafter else None
                tokens = seq if rng.random() < 0.8 else torch.tensor(seq)
                added = pc.store(tokens, target, drafter)
                now_target, now_drafter = held(pc)
                now = now_drafter if with_drafter else now_target
                assert all(tuple(seq[:i]) in now for i in range(1, fits + 1)), (seed, seq, fits)
                if fits == len(seq):  # it fits whole: added exactly when some of it was missing
                    assert added == any(tuple(seq[:i]) not in before for i in range(1, len(seq) + 1))
                target.fill_(-7)  # the tree holds copies
                if drafter is not None:
                    drafter.fill_(-7)
                pool = (pool + [seq])[-30:]
            elif r < 0.93:
                target_held, drafter_held = held(pc)
                can = drafter_held if with_drafter else target_held
                want = next((m for m in range(len(seq) - 1, 0, -1) if tuple(seq[:m]) in can), 0)
                n, entry = pc.match(seq, with_drafter)
                assert n == want, (seed, seq, with_drafter)
                if n:
                    assert entry.tokens.tolist() == seq[:n] and torch.equal(entry.target, target_kv(seq[:n]))
                    assert (entry.drafter is None) if not with_drafter else torch.equal(entry.drafter,
                                                                                          drafter_kv(seq[:n]))
                    entry.target.fill_(-1)  # a copy: the tree is unchanged (check_tree)
                else:
                    assert entry is None
            else:
                pc.clear()
                stored, stored_with_drafter = set(), set()
                assert pc.nbytes == len(pc) == pc.held_tokens == 0
            check_tree(pc, stored, stored_with_drafter)
