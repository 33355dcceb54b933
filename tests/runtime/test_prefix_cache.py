"""Automatic prefix caching (`dflash_trt.runtime.prefix_cache`): the store's matching, replacement and memory
bound on small tensors, and on the real SmolLM2 pipeline: a prompt that starts with a sequence read before is
prefilled from where it differs, with the same tokens as without the cache (DFlash and autoregressive, greedy
and seeded sampling, chunked prefill), and exactly the reused tokens counted."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.runtime.decode_batch import DecodeBatch
from dflash_trt.runtime.kv_cache import KVCache
from dflash_trt.runtime.prefix_cache import PrefixCache
from dflash_trt.runtime.sampling import SamplingParams


def kv(n: int, fill: float = 1.0, layers: int = 2) -> torch.Tensor:
    """K/V of n tokens: [2, layers, 1 head, n, 4] float32 (4 * 2 * layers * 4 bytes = 32 * layers bytes a token)."""
    return torch.full((2, layers, 1, n, 4), fill)


def test_match_takes_the_longest_shared_prefix_but_never_the_last_prompt_token():
    pc = PrefixCache(1 << 20)
    assert pc.store([1, 2, 3, 4, 5], kv(5), kv(5)) and pc.store([1, 2, 9], kv(3, 2.0), kv(3, 2.0))
    n, e = pc.match([1, 2, 3, 4, 7, 8], with_drafter=True)
    assert n == 4 and e.tokens.tolist() == [1, 2, 3, 4] and e.target.shape == e.drafter.shape == (2, 2, 1, 4, 4)
    n, e = pc.match([1, 2, 3], with_drafter=True)  # all three are held, the last one is read anyway
    assert n == 2 and e.tokens.tolist() == [1, 2]
    n, e = pc.match([1, 2, 9, 9], with_drafter=True)
    assert n == 3 and e.tokens.tolist() == [1, 2, 9]
    assert e.target[:, :, :, :2].eq(1.0).all() and e.target[:, :, :, 2].eq(2.0).all()  # [1, 2] kept from the first
    assert pc.match([7, 1, 2], with_drafter=True) == (0, None)
    assert pc.match([1], with_drafter=True) == (0, None)
    assert pc.match([], with_drafter=False) == (0, None)
    assert pc.match([1, 2, 3], with_drafter=False)[1].drafter is None


def test_sequences_sharing_a_prefix_hold_it_once():
    """The radix tree: a system prompt read by three conversations is one node; each keeps only its own part."""
    per_token = 2 * (2 * 2 * 4 * 4)  # target + drafter K/V, 2 layers, 1 head, head_dim 4, float32
    system = list(range(100, 120))
    pc = PrefixCache(1 << 20)
    for i in range(3):
        assert pc.store(system + [i, i, i], kv(23, float(i)), kv(23, float(i)))
    assert len(pc) == 3 and pc.nbytes == (20 + 3 * 3) * per_token and pc.held_tokens == 29
    assert sorted(pc.sequences()) == [system + [i] * 3 for i in range(3)]
    n, e = pc.match(system + [2, 2, 5], with_drafter=True)
    assert n == 22 and e.target[:, :, :, :20].eq(0.0).all() and e.target[:, :, :, 20:].eq(2.0).all()
    # a sequence ending inside a node adds nothing; one diverging inside it splits it
    assert not pc.store(system[:7], kv(7), kv(7)) and pc.nbytes == 29 * per_token
    assert pc.store(system[:7] + [0], kv(8, 5.0), kv(8, 5.0)) and len(pc) == 4 and pc.nbytes == 30 * per_token
    n, e = pc.match(system[:7] + [0, 1], with_drafter=True)
    assert n == 8 and e.target[:, :, :, :7].eq(0.0).all() and e.target[:, :, :, 7].eq(5.0).all()
    assert pc.match(system + [1, 1, 1, 1], with_drafter=True)[0] == 23  # across the split
    pc.clear()
    assert len(pc) == 0 and pc.nbytes == 0 and pc.match(system + [0], True) == (0, None)


def test_the_drafters_context_is_filled_in_over_an_autoregressive_sequence():
    per_token = 2 * 2 * 4 * 4  # one cache's K/V a token
    pc = PrefixCache(1 << 20)
    assert pc.store([1, 2, 3, 4], kv(4), None)
    assert pc.match([1, 2, 3, 4, 5], with_drafter=True) == (0, None)  # held for "ar" only
    n, e = pc.match([1, 2, 3, 4, 5], with_drafter=False)
    assert n == 4 and e.drafter is None
    # a DFlash sequence ending inside it: the node splits, its first part gains the drafter's context
    assert pc.store([1, 2, 3], kv(3), kv(3, 3.0)) and len(pc) == 1 and pc.nbytes == (4 + 3) * per_token
    n, e = pc.match([1, 2, 3, 4, 5], with_drafter=True)
    assert n == 3 and e.drafter.eq(3.0).all()
    assert pc.match([1, 2, 3, 4, 5], with_drafter=False)[0] == 4
    # held already, with or without the drafter's context: nothing added
    assert not pc.store([1, 2], kv(2), None) and not pc.store([1, 2, 3], kv(3), kv(3))
    assert pc.store([1, 2, 3, 4, 6], kv(5), kv(5)) and pc.nbytes == (5 + 5) * per_token  # [4] gains it too
    assert pc.match([1, 2, 3, 4, 6, 0], with_drafter=True)[0] == 5


def test_least_recently_used_leaves_go_when_the_bytes_pass_the_bound():
    per_token = 2 * (2 * 2 * 4 * 4)
    pc = PrefixCache(10 * per_token)
    pc.store([1, 1, 1, 1], kv(4), kv(4))
    pc.store([2, 2, 2, 2], kv(4), kv(4))
    assert pc.match([1, 1, 1, 1, 0], True)[0] == 4  # [1...] is now the most recently used
    pc.store([3, 3, 3], kv(3), kv(3))  # 11 tokens > 10: the least recently used ([2...]) goes
    assert sorted(s[0] for s in pc.sequences()) == [1, 3] and pc.nbytes == 7 * per_token
    assert not PrefixCache(per_token - 1).store([1, 2], kv(2), kv(2))  # not even one token fits: nothing kept
    big = PrefixCache(10 * per_token)
    assert big.store([9], kv(1), kv(1)) and big.store(list(range(11)), kv(11, 4.0), kv(11, 4.0))  # alone above it:
    assert big.sequences() == [list(range(10))] and big.nbytes == 10 * per_token  # its longest prefix that fits
    n, e = big.match(list(range(12)), True)
    assert n == 10 and e.target.eq(4.0).all()
    # a shared node goes only after every sequence continuing it: [1, 1] + two branches, then a newer sequence
    pc = PrefixCache(8 * per_token)
    pc.store([1, 1, 5, 5], kv(4), kv(4))
    pc.store([1, 1, 6, 6], kv(4), kv(4))  # 6 tokens held
    pc.store([7, 7, 7, 7], kv(4), kv(4))  # 10: [1, 1, 5, 5]'s leaf goes (8), [1, 1] stays for [1, 1, 6, 6]
    assert sorted(pc.sequences()) == [[1, 1, 6, 6], [7, 7, 7, 7]] and pc.nbytes == 8 * per_token
    pc.store([8, 8, 8], kv(3), kv(3))  # 11: [6, 6] goes (9), then [1, 1] is a leaf and goes before [7...] (7)
    assert pc.sequences() == [[7, 7, 7, 7], [8, 8, 8]] and pc.nbytes == 7 * per_token


def test_a_sequence_fits_with_what_its_path_holds_already_or_is_not_kept():
    """An "ar" sequence under a prefix holding the drafter's context too: the path that must stay holds those bytes
    as well. Too big with them: its longest prefix that fits with them is kept (it once dropped every other sequence,
    then itself)."""
    def kv2(n: int, d: int) -> torch.Tensor:  # 16 * d bytes a token
        return torch.zeros(2, 1, 1, n, d, dtype=torch.int64)

    pc = PrefixCache(200)
    assert pc.store([5], kv2(1, 2), kv2(1, 3))  # 32 + 48 bytes
    assert pc.store([7], kv2(1, 2), None)  # 112
    assert pc.store([5, 1, 1, 1, 1], kv2(5, 2), None)  # its path: 80 + 4 * 32 = 208 > 200; [5, 1, 1, 1]: 176
    assert pc.sequences() == [[5, 1, 1, 1]] and pc.nbytes == 176  # [7] went for it
    pc = PrefixCache(240)  # a sequence diverging inside a node: its rest is new, whatever that node's children
    assert pc.store([1, 1, 0], kv2(3, 2), kv2(3, 3))  # 240 bytes
    assert pc.store([1, 0, 0, 0, 0, 1], kv2(6, 2), None)  # [1] (80) + 5 * 32 = 240: fits once [1, 0] (160) goes
    assert pc.sequences() == [[1, 0, 0, 0, 0, 1]] and pc.nbytes == 240


def test_one_store_drops_many_sequences_at_once_and_dropped_nodes_are_freed_at_once():
    import gc
    import time
    import weakref

    per_token = 2 * 1 * 4 * 4  # kv(n, layers=1): float32
    pc = PrefixCache(3000 * per_token)
    for i in range(1500):  # 1500 two-token sequences sharing nothing: the cache is full
        pc.store([i, i], kv(2, layers=1), None)
    assert len(pc) == 1500 and pc.nbytes == 3000 * per_token
    t0 = time.perf_counter()
    assert pc.store(list(range(5000, 7000)), kv(2000, layers=1), None)  # drops 1000 of them in one store
    assert time.perf_counter() - t0 < 2.0  # a heap of leaves, not a walk of the tree per dropped leaf
    assert len(pc) == 501 and pc.nbytes == 3000 * per_token
    assert [s[0] for s in pc.sequences()[:2]] == [1000, 1001]  # the oldest 1000 went
    pc.store([1, 2, 3, 4], kv(4, layers=1), None)
    pc.store([1, 2, 9, 9], kv(4, layers=1), None)  # [1, 2] is now a node with two children
    assert pc.match(torch.tensor([1, 2, 3, 0]), False)[0] == 3  # a tensor prompt matches as a list does
    gc.disable()
    try:
        inner = next(n for n in pc._nodes() if n.tokens == (1, 2))
        ref = weakref.ref(inner.target)
        del inner
        pc.clear()
        assert ref() is None  # no parent <-> child cycle waits for the garbage collector
    finally:
        gc.enable()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_bytes must be a whole number of bytes >= 1"):
        PrefixCache(0)
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(True)
    with pytest.raises(ValueError, match=r"for 3 tokens: want \[2, layers, kv_heads, 3, head_dim\]"):
        PrefixCache(100).store([1, 2, 3], kv(4), None)
    assert not PrefixCache(100).store([], kv(0), None)


def test_kv_cache_rows_read_and_import():
    a = KVCache(num_layers=3, batch=2, kv_heads=2, capacity=8, head_dim=4)
    a.buffer.copy_(torch.randn_like(a.buffer))
    part = a.read_row(1, 5)
    assert part.shape == (2, 3, 2, 5, 4) and torch.equal(part, a.buffer[:, :, 1, :, :5])
    assert part.data_ptr() == a.buffer[:, :, 1].data_ptr()  # a view: the tree copies what it keeps, only that
    b = KVCache(num_layers=3, batch=3, kv_heads=2, capacity=6, head_dim=4)
    b.import_row(2, part)
    assert b.lengths == [0, 0, 5] and torch.equal(b.buffer[:, :, 2, :, :5], part)
    assert not b.buffer[:, :, :2].any() and not b.buffer[:, :, 2, :, 5:].any()
    b.import_row(1, (part[:, :, :, :2], part[:, :, :, 2:3], part[:, :, :, 3:]))  # a match's parts, in order
    assert b.lengths == [0, 5, 5] and torch.equal(b.buffer[:, :, 1, :, :5], part) and not b.buffer[:, :, 1, :, 5:].any()
    b.import_row(0, ())  # no parts: an empty row
    assert b.lengths == [0, 5, 5] and not b.buffer[:, :, 0].any()
    with pytest.raises(ValueError, match="cannot import K/V of shape"):
        b.import_row(0, a.read_row(0, 7))  # 7 slots into a capacity of 6
    with pytest.raises(ValueError, match=r"cannot import K/V of shape \(2, 3, 2, 4, 4\) \(of 8 slots in all\)"):
        b.import_row(0, (part[:, :, :, :4], part[:, :, :, :4]))  # parts of 8 slots in all
    with pytest.raises(ValueError, match="cannot import K/V of shape"):
        KVCache(2, 1, 2, 8, 4).import_row(0, part)  # another number of layers
    with pytest.raises(ValueError, match="length 9 outside"):
        a.read_row(0, 9)


def test_store_copies_only_what_the_tree_lacks():
    """`store` is given views of a cache row: the nodes it adds own copies of just their part (bytes counted
    exactly, the row free to be written again), and a match's parts are views of the nodes (no copy made)."""
    cache = KVCache(num_layers=2, batch=1, kv_heads=1, capacity=10, head_dim=2)
    cache.buffer.copy_(torch.arange(cache.buffer.numel(), dtype=torch.float32).view_as(cache.buffer))
    per_token = 2 * 2 * 1 * 2 * 4
    pc = PrefixCache(10**6)
    assert pc.store([1, 2, 3, 4], cache.read_row(0, 4), None)
    first = cache.read_row(0, 6).clone()
    assert pc.store([1, 2, 3, 4, 5, 6], cache.read_row(0, 6), None) and pc.nbytes == 6 * per_token
    new = next(iter(next(iter(pc._root.children.values())).children.values()))  # the node of [5, 6]
    assert new.tokens == (5, 6) and new.target.untyped_storage().nbytes() == 2 * per_token
    cache.buffer.fill_(-1)  # the row is written again: what the tree holds does not change
    n, e = pc.match([1, 2, 3, 4, 5, 6, 7], with_drafter=False)
    assert n == 6 and len(e.target_parts) == 2 and torch.equal(e.target, first)
    assert e.target_parts[1].data_ptr() == new.target.data_ptr()


@pytest.fixture
def caching(smollm2_pipeline):
    """The session pipeline's engine with a fresh 1 GiB prefix cache for one test (none again after it)."""
    eng = smollm2_pipeline.engine
    eng.prefix_cache = PrefixCache(1 << 30)
    try:
        yield eng.prefix_cache
    finally:
        eng.prefix_cache = None


def chat(pipe, *turns: str, answers: tuple[str, ...] = ()) -> list[int]:
    from dflash_trt.training.prompts import encode_prompt

    messages = []
    for i, q in enumerate(turns):
        messages.append({"role": "user", "content": q})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return encode_prompt(pipe.tokenizer, messages)


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def decode(eng, mode: str, prompts: list[list[int]], params, chunk: int | None = None) -> list:
    """Every request of one `DecodeBatch.add` call decoded to its end: the results in the order added."""
    batch = DecodeBatch(eng, mode, chunk)
    batch.add(prompts, params)
    while batch.active:
        batch.step()
    return [r for _, r in sorted(batch.take_finished())]


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_the_next_turn_of_a_chat_reuses_the_first_and_gives_the_same_tokens(smollm2_pipeline, caching, mode):
    pipe = smollm2_pipeline
    sp = SamplingParams(max_tokens=40)
    first = chat(pipe, "Name three rivers of Europe.")
    pipe.engine.prefix_cache = None
    [ref1] = pipe.generate([first], sp, mode=mode)
    second = chat(pipe, "Name three rivers of Europe.", "Which one is the longest?", answers=(pipe.decode(ref1.token_ids),))
    [ref2] = pipe.generate([second], sp, mode=mode)
    pipe.engine.prefix_cache = caching
    [got1] = pipe.generate([first], sp, mode=mode)
    assert got1.token_ids == ref1.token_ids and got1.metrics.cached_tokens == 0
    [held] = caching.sequences()  # the first turn read, to where its K/V are written
    seq = first + got1.token_ids
    assert held == seq[: len(held)] and len(seq) - 1 <= len(held) <= len(seq)
    if mode == "ar":  # one token per step: the last one (EOS) is never read
        assert len(held) == len(seq) - 1
    [got2] = pipe.generate([second], sp, mode=mode)
    assert got2.token_ids == ref2.token_ids
    reused = shared(second[:-1], held)
    assert reused > len(first) and got2.metrics.cached_tokens == reused
    assert got2.metrics.prompt_tokens == len(second)
    assert (caching.queried_tokens, caching.hit_tokens) == (len(first) + len(second), reused)


@pytest.mark.parametrize("chunk", [None, 5])
def test_requests_added_together_each_reuse_their_own_prefix(smollm2_pipeline, caching, chunk):
    """One add call (one forward per chunk) whose requests reuse 0, a little and most of their prompts, and two
    that repeat one prompt (read once, copied): each starts its prefill where its own cached prefix ends, with
    the tokens of a run without the cache, also when read 5 positions per step."""
    pipe = smollm2_pipeline
    eng = pipe.engine
    sp = SamplingParams(max_tokens=10)
    story = pipe.encode("The old lighthouse keeper climbed the stairs every night to light the lamp, and")
    prompts = [story + pipe.encode(" then he"), pipe.encode("Seven facts about owls: first,"),
               story[:6] + pipe.encode(" a completely different ending, where the"),
               story + pipe.encode(" then he"), pipe.encode("Q: What is 2 + 2?\nA:")]

    def run(batch_prompts):
        return decode(eng, "dflash", batch_prompts, sp, chunk)

    eng.prefix_cache = None
    refs = run(prompts)
    eng.prefix_cache = caching
    run([story])  # what is cached: the story, and its 10 tokens
    [held] = caching.sequences()
    got = run(prompts)
    assert [g.token_ids for g in got] == [r.token_ids for r in refs]
    want = [shared(p[:-1], held) for p in prompts]
    assert want[0] == want[3] == len(story) and want[2] == 6 and want[1] == want[4] == 0
    assert [g.metrics.cached_tokens for g in got] == want
    assert [g.metrics.prompt_tokens for g in got] == [len(p) for p in prompts]


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_requests_added_together_reuse_each_others_shared_prefix(smollm2_pipeline, caching, mode):
    """One add call, nothing cached: three prompts sharing a long system prompt, an unrelated one, and one asking for
    prompt logprobs. The first of the three is read whole; the other two copy the shared part from its row and read
    the rest (cached_tokens counts it, the cache's hit counter too), with the tokens of a run without the cache;
    not with chunked prefill (rows read in step), nor for the prompt-logprobs row (every position read)."""
    pipe = smollm2_pipeline
    eng = pipe.engine
    system = pipe.encode("You are a helpful assistant for a travel agency. Answer in one short sentence, politely, "
                         "and never invent prices or dates.")
    prompts = [system + pipe.encode(f" Q: {q}? A:") for q in ("Where is Rome", "What is Paris known for",
                                                                  "Is Oslo cold")]
    prompts.insert(2, pipe.encode("Seven facts about owls: first,"))
    prompts.append(system + pipe.encode(" Q: Is Nice sunny? A:"))
    prompts.append(prompts[1])  # a repeat of a row that copies the shared part (a request's second choice)
    params = [SamplingParams(max_tokens=12)] * 4 + [SamplingParams(max_tokens=12, prompt_logprobs=1),
                                                    SamplingParams(max_tokens=12)]

    def run(chunk=None):
        return decode(eng, mode, prompts, params, chunk)

    eng.prefix_cache = None
    refs = run()
    eng.prefix_cache = caching
    got = run()
    shared_with_first = [shared(p[:-1], prompts[0]) for p in prompts]
    assert shared_with_first[1] == shared_with_first[3] >= len(system) >= 16
    assert [g.metrics.cached_tokens for g in got] == [0, shared_with_first[1], 0, shared_with_first[3], 0,
                                                       shared_with_first[1]]  # the repeat: as the row it copies
    assert [g.token_ids for g in got] == [r.token_ids for r in refs] and got[5].token_ids == got[1].token_ids
    assert caching.hit_tokens == 2 * shared_with_first[1] + shared_with_first[3]
    caching.clear()
    chunked = run(chunk=8)
    assert [g.metrics.cached_tokens for g in chunked] == [0] * 6
    assert [g.token_ids for g in chunked] == [r.token_ids for r in refs]


def test_seeded_sampling_chunked_prefill_and_prompt_logprobs_with_a_cached_prefix(smollm2_pipeline, caching):
    pipe = smollm2_pipeline
    eng = pipe.engine
    long = pipe.encode("Once upon a time, in a village by the sea, there lived an old fisherman who " * 3)
    longer = long + pipe.encode(" Every morning he")
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    logprobs = SamplingParams(max_tokens=4, prompt_logprobs=2)

    def run(prompt, sp, chunk=None):
        return decode(eng, "dflash", [prompt], sp, chunk)[0]

    eng.prefix_cache = None
    ref_sampled, ref_chunked, ref_lp = run(longer, sampled), run(longer, SamplingParams(max_tokens=24), 8), run(longer, logprobs)
    eng.prefix_cache = caching

    def prime():  # only `long` read before
        caching.clear()
        run(long, SamplingParams(max_tokens=1))
        assert [len(s) for s in caching.sequences()] == [len(long)]

    prime()
    got = run(longer, sampled)
    assert got.token_ids == ref_sampled.token_ids and got.metrics.cached_tokens == len(long)
    prime()
    got = run(longer, SamplingParams(max_tokens=24), 8)  # prefilled in chunks of 8 from the cached prefix
    assert got.token_ids == ref_chunked.token_ids and got.metrics.cached_tokens == len(long)
    prime()
    got = run(longer, logprobs)  # prompt logprobs need every prompt position read: no reuse
    assert got.metrics.cached_tokens == 0 and got.token_ids == ref_lp.token_ids
    assert len(got.prompt_logprobs) == len(longer) and got.prompt_logprobs[0] is None
    assert [p.token_id for p in got.prompt_logprobs[1:]] == longer[1:]
    assert [round(p.logprob, 4) for p in got.prompt_logprobs[1:]] == [round(p.logprob, 4) for p in ref_lp.prompt_logprobs[1:]]


def test_a_prefix_cache_too_small_for_a_sequence_keeps_its_longest_prefix_that_fits(smollm2_pipeline):
    pipe = smollm2_pipeline
    prompt = pipe.encode("A short prompt about the weather today in Paris and")
    pipe.engine.prefix_cache = PrefixCache(1024)  # less than one token's K/V of 30 layers
    try:
        pipe.generate([prompt], SamplingParams(max_tokens=4))
        [got] = pipe.generate([prompt], SamplingParams(max_tokens=4))
        assert len(pipe.engine.prefix_cache) == 0 and got.metrics.cached_tokens == 0
        pipe.engine.prefix_cache = roomy = PrefixCache(1 << 30)
        pipe.generate([prompt], SamplingParams(max_tokens=4))
        per_token = roomy.nbytes // roomy.held_tokens  # a token's K/V, target + drafter
        pipe.engine.prefix_cache = PrefixCache(5 * per_token)  # room for 5: the prompt's first 5 kept and reused
        [first] = pipe.generate([prompt], SamplingParams(max_tokens=4))
        [again] = pipe.generate([prompt], SamplingParams(max_tokens=4))
        assert pipe.engine.prefix_cache.sequences() == [prompt[:5]] and again.metrics.cached_tokens == 5
        assert again.token_ids == first.token_ids == got.token_ids
    finally:
        pipe.engine.prefix_cache = None


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_a_chunked_group_split_keeps_room_for_a_long_cached_prefix(smollm2_pipeline, caching, mode):
    """Chunked prefill of [a short prompt, a long one, a cached prefix + 70 tokens]: the short one joins after the
    first chunk, and the two left still read 64 positions per chunk, the third past its 150 cached tokens (once
    padded to the long one's part, stale slots up to 150 + 200 that its split cache had no room for: an
    IndexError; now read in a forward of its own, its padding kept to its first free slot)."""
    import random

    eng = smollm2_pipeline.engine
    rng = random.Random(1)
    pre = [rng.randrange(100, 1000) for _ in range(150)]
    prompts = [[rng.randrange(100, 1000) for _ in range(5)], [rng.randrange(100, 1000) for _ in range(200)],
               pre + [rng.randrange(100, 1000) for _ in range(70)]]
    sp = SamplingParams(max_tokens=3)

    def run():
        return decode(eng, mode, prompts, sp, 64)

    eng.prefix_cache = None
    refs = run()
    eng.prefix_cache = caching
    smollm2_pipeline.generate([pre + [5]], SamplingParams(max_tokens=1), mode=mode)
    got = run()
    assert [g.metrics.cached_tokens for g in got] == [0, 0, 150]
    assert [g.token_ids for g in got] == [r.token_ids for r in refs]


def test_prefill_forwards_keep_cached_rows_apart_from_long_fresh_ones():
    """`Engine._forwards`: rows without a cached prefix in one forward (as before prefix caching); rows with one,
    longest first, share a forward while their padding is at most 16 tokens or a quarter of its length."""
    from dflash_trt.runtime.engine import PAD_TOKENS, Engine

    assert PAD_TOKENS == 16
    skip = [0, 100, 0, 50, 7, 9]
    assert Engine._forwards([0, 1, 2, 3, 4], skip, {0: 10, 1: 1, 2: 30, 3: 40, 4: 35}) == [[0, 2], [3, 4], [1]]
    assert Engine._forwards([1, 3, 4, 5], skip, {1: 1, 3: 200, 4: 150, 5: 149}) == [[3, 4], [5], [1]]
    assert Engine._forwards([0, 2], skip, {0: 5, 2: 500}) == [[0, 2]]  # no prefix: padded together, as before
    assert Engine._forwards([1], skip, {1: 3}) == [[1]]


def test_rows_of_a_forward_out_of_cache_order_write_their_own_rows(smollm2_pipeline, caching):
    """Two requests, both past a cached prefix, the second reading more: their forward takes the longer first
    (rows [1, 0]); each must still write its own cache row (all rows in a forward once meant rows in order)."""
    pipe = smollm2_pipeline
    eng = pipe.engine
    base = pipe.encode("A recipe for bread: mix flour, water, salt and yeast, then knead the dough for ten minutes")
    prompts = [base + pipe.encode(" and let"), base + pipe.encode(" until it is smooth and elastic, then")]
    sp = SamplingParams(max_tokens=12)
    eng.prefix_cache = None
    refs = pipe.generate(prompts, sp)
    eng.prefix_cache = caching
    pipe.generate([base + [13]], SamplingParams(max_tokens=1))
    got = pipe.generate(prompts, sp)
    reads = [len(p) - g.metrics.cached_tokens for p, g in zip(prompts, got)]
    assert got[0].metrics.cached_tokens == got[1].metrics.cached_tokens == len(base) and reads[0] < reads[1]
    assert [g.token_ids for g in got] == [r.token_ids for r in refs]
