"""KV caches sized by the tokens produced, not by max_tokens: a `DecodeBatch` gives a request's rows room for its
prompt and INITIAL_OUTPUT_SLOTS output tokens, doubles the target's and the drafter's caches before a step could
write past them and shrinks them when requests leave; the outputs are token for token those of caches sized for
max_tokens up front (INITIAL_OUTPUT_SLOTS made huge: the old sizing)."""

from __future__ import annotations

import pytest

import dflash_trt.runtime.decode_batch as decode_batch
from dflash_trt.config import TargetConfig
from dflash_trt.models.checkpoints import init_drafter, load_drafter, load_target, new_drafter_config
from dflash_trt.runtime.decode_batch import DecodeBatch
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.kv_cache import KVCache
from dflash_trt.runtime.prefix_cache import PrefixCache
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams
from tests.conftest import make_hf_model

UP_FRONT = 10**9  # INITIAL_OUTPUT_SLOTS that sizes every request for its max_tokens at once (the old sizing)
INITIAL = decode_batch.INITIAL_OUTPUT_SLOTS  # the default


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny random llama target (512 positions, 4 layers, 2 KV heads of 16) and a 1-layer block-4 drafter."""
    tmp = tmp_path_factory.mktemp("kvgrow")
    _, folder = make_hf_model(tmp, "llama", vocab=96, seed=7)
    target = load_target(folder)
    dcfg = new_drafter_config(TargetConfig.from_pretrained(folder), 1, 4, 95, [1, 3])
    return target, load_drafter(init_drafter(dcfg, tmp / "d", seed=2))


def make_engine(models, variant: str = "chain") -> Engine:
    target, drafter = models
    engine = Engine(target, DFlashProposer(drafter, target, tree_topk=3 if variant == "tree" else 1))
    if variant == "prefix":
        engine.prefix_cache = PrefixCache(1 << 24)
    return engine


def caches(batch: DecodeBatch) -> list[KVCache]:
    return [c for c in (batch.cache, batch._drafter_cache) if c is not None]


def run(batch: DecodeBatch, steps: list | None = None) -> dict:
    """Step `batch` to its end; each step's (capacity of each cache, buffer numel of each, rows, the largest
    max_slots of its live requests) goes to `steps`. Returns {request id: token ids}."""
    done = {}
    while batch.active:
        batch.step()
        if steps is not None and batch.cache is not None:
            steps.append(([c.capacity for c in caches(batch)], [c.buffer.numel() for c in caches(batch)],
                          batch.cache.batch, max((r.max_slots for r in batch.live), default=0)))
        done.update((i, r.token_ids) for i, r in batch.take_finished())
    return done


def numel(cache: KVCache, capacity: int, rows: int) -> int:
    """Elements of a buffer of `rows` rows of `capacity` slots in `cache`'s layout."""
    _, layers, _, heads, _, dim = cache.buffer.shape
    return 2 * layers * rows * heads * capacity * dim


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_a_short_answer_with_a_huge_max_tokens_keeps_small_caches(models, mode, monkeypatch):
    """max_tokens far past the context (capped there: 512 positions), answers stopped after 10 tokens: the caches
    hold the prompt, INITIAL_OUTPUT_SLOTS tokens, a block and one, never the 500-odd slots max_tokens allows;
    the tokens equal those of caches sized for max_tokens up front."""
    engine = make_engine(models)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 22))]
    params = [SamplingParams(max_tokens=10**9, ignore_eos=True, temperature=t, seed=4) for t in (0.0, 1.0)]

    def stop_at_10(k, ids, count={}):
        count[k] = count.get(k, 0) + len(ids)
        return "stop" if count[k] >= 10 else None

    outputs, sizes = [], []
    for initial in (INITIAL, UP_FRONT):
        monkeypatch.setattr(decode_batch, "INITIAL_OUTPUT_SLOTS", initial)
        batch = DecodeBatch(engine, mode)
        ids = batch.add(prompts, params, lambda k, t, c={}: stop_at_10(k, t, c))
        steps = [([c.capacity for c in caches(batch)], [c.buffer.numel() for c in caches(batch)], 2, 0)]
        done = run(batch, steps)
        outputs.append([done[i] for i in ids])
        sizes.append(steps)
    assert outputs[0] == outputs[1] and all(10 <= len(t) < 10 + batch.block for t in outputs[0])
    both, one = 12 + INITIAL + batch.block + 1, 5 + INITIAL + batch.block + 1  # (the other row left: shrunk)
    full = 512 + batch.block + 1  # the context (the cap of prompt + max_tokens), a block and one
    assert sizes[0][0][0] == [both] * len(caches(batch))
    for caps, elems, rows, _ in sizes[0]:
        assert caps in ([both] * len(caps), [one] * len(caps))
        assert elems == [numel(c, caps[0], rows) for c in caches(batch)]
    assert sizes[1][0][0][0] == full  # the old sizing, for scale


@pytest.mark.parametrize("variant,mode,temperature", [  # draft trees are for greedy DFlash rows only
    (v, m, t) for v in ("chain", "tree", "chunked", "prefix") for m in ("dflash", "ar") for t in (0.0, 1.0)
    if v != "tree" or (m, t) == ("dflash", 0.0)])
def test_long_answers_grow_the_caches_and_equal_the_up_front_sizing(models, variant, mode, temperature, monkeypatch):
    """Answers of 160 and 100 tokens from prompts of 3 and 9 (and 90 from 32 with a cached prefix): the caches start at
    the longest prompt + INITIAL_OUTPUT_SLOTS + a block + 1, grow at least twice (once from the cached prefix's 101), each time to twice the capacity
    or the largest max_slots of the live rows, never past it; target and drafter caches stay the same size; the
    tokens (greedy and seeded sampling; chains, draft trees, chunked prefill, a reused prefix) are those of
    caches sized for max_tokens up front."""
    engine = make_engine(models, variant)
    shared = list(range(20, 50))
    prompts = [[3, 4, 5], [60, 61, 62, 63, 64, 65, 66, 67, 68]] + ([shared + [7, 8]] if variant == "prefix" else [])
    budgets = [160, 100, 90][: len(prompts)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=temperature, seed=10 + i)
              for i, m in enumerate(budgets)]
    outputs, traces, hits = [], [], []
    for initial in (INITIAL, UP_FRONT):
        monkeypatch.setattr(decode_batch, "INITIAL_OUTPUT_SLOTS", initial)
        if variant == "prefix":
            engine.prefix_cache = PrefixCache(1 << 24)
            engine.generate([shared], SamplingParams(max_tokens=1), mode)  # kept: the third prompt starts with it
        batch = DecodeBatch(engine, mode, prefill_chunk=4 if variant == "chunked" else None)
        ids = batch.add(prompts, params)
        traces.append([])
        done = run(batch, traces[-1])
        outputs.append([done[i] for i in ids])
        hits.append(engine.prefix_cache.hit_tokens if variant == "prefix" else None)
    assert outputs[0] == outputs[1] and [len(t) for t in outputs[0]] == budgets
    assert hits[0] == hits[1] and (variant != "prefix" or hits[0] >= len(shared) - 1)
    block = batch.block
    if variant != "chunked":  # (chunked: the short prompts' rows decode while the others are read)
        assert traces[0][0][0][0] == max(len(p) for p in prompts) + INITIAL + block + 1
    growths = 0
    for (before, _, rows_before, _), (after, elems, rows, most) in zip(traces[0], traces[0][1:]):
        assert len(set(after)) == 1 and elems == [numel(c, after[0], rows) for c in caches(batch)[: len(elems)]]
        assert after[0] <= most  # never more than a live row can write
        if after[0] > before[0] and rows == rows_before:  # (a row joining brings its own capacity)
            growths += 1
            assert after[0] == min(2 * before[0], most)
    assert growths >= (1 if variant == "prefix" else 2)  # (prefix: from 101 slots to its max_slots, 168)


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_requests_joining_and_leaving_while_the_caches_grow(models, mode, monkeypatch):
    """A running request (160 tokens) whose caches have grown once is joined by a 40-token prompt and a 5-token
    one (their rows padded to the batch's capacity), which leave while it grows on; a request joining late
    outlives it, and when the long one leaves the caches shrink to what the late one can still write; every
    output equals its request alone with caches sized for max_tokens up front."""
    engine = make_engine(models)
    prompts = [[3, 4, 5], list(range(30, 70)), [9, 10, 11, 12, 13], [20, 21, 22, 23, 24]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=t, seed=i)
              for i, (m, t) in enumerate([(160, 1.0), (40, 0.0), (6, 1.0), (60, 0.0)])]
    monkeypatch.setattr(decode_batch, "INITIAL_OUTPUT_SLOTS", UP_FRONT)
    alone = [engine.generate([p], [sp], mode)[0].token_ids for p, sp in zip(prompts, params)]
    monkeypatch.undo()
    batch = DecodeBatch(engine, mode)
    sizes = lambda: [c.capacity for c in caches(batch)]  # noqa: E731
    out_a: list[int] = []
    ids = batch.add(prompts[:1], params[:1], lambda k, t: out_a.extend(t))
    block, start = batch.block, batch.cache.capacity
    assert start == 3 + INITIAL + block + 1
    done: dict = {}
    while batch.cache.capacity == start:
        batch.step()
    assert sizes() == [2 * start] * len(sizes())
    ids += batch.add(prompts[1:3], params[1:3])  # they join mid-growth
    assert batch.cache.batch == 3 and sizes() == [2 * start] * len(sizes())
    while len(out_a) < 145:
        batch.step()
        done.update((i, r.token_ids) for i, r in batch.take_finished())
    most = 3 + 160 + block + 1  # all the first request can write
    assert sizes() == [most] * len(sizes())  # grown again, to its max_slots
    ids += batch.add(prompts[3:], params[3:])  # outlives the first
    steps: list = []
    done.update(run(batch, steps))
    assert [done[i] for i in ids] == alone
    alone_caps = [s[0] for s in steps if s[2] == 1]  # the late request alone: the first one's slots are freed
    assert alone_caps and all(caps[0] < most and caps[0] <= 5 + 60 + block + 1 for caps in alone_caps)
    assert all(len(set(caps)) == 1 for caps in alone_caps)
