"""Ragged batches on a tiny model: requests finish at different steps (their cache rows are dropped
as they finish) and each output still equals the request decoded alone."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.config import TargetConfig
from dflash_trt.models.checkpoints import init_drafter, load_drafter, load_target, new_drafter_config
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.kv_cache import KVCache
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams
from tests.conftest import make_hf_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    _, folder = make_hf_model(tmp, "llama", vocab=96, seed=7)
    target = load_target(folder)
    dcfg = new_drafter_config(TargetConfig.from_pretrained(folder), 1, 4, 95, [1, 3])
    drafter = load_drafter(init_drafter(dcfg, tmp / "d", seed=2))
    return Engine(target, DFlashProposer(drafter, target))


@pytest.mark.parametrize("mode", ["dflash", "ar"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_requests_finishing_at_different_steps(engine, mode, temperature):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 95, (n,), generator=g).tolist() for n in (3, 11, 6, 17, 1, 9)]
    params = [SamplingParams(temperature=temperature, max_tokens=m, seed=i, ignore_eos=True)
              for i, m in enumerate((5, 23, 1, 12, 30, 8))]
    alone = [engine.generate([p], [sp], mode)[0].token_ids for p, sp in zip(prompts, params)]
    together = engine.generate(prompts, params, mode)
    assert [r.token_ids for r in together] == alone
    assert [len(r.token_ids) for r in together] == [5, 23, 1, 12, 30, 8]


def test_keep_rows_drops_and_reorders_rows():
    cache = KVCache(1, 3, 1, 4, 2)
    for r in range(3):
        cache.k[0][r] = r
        cache.set_length(r, r + 1)
    cache.keep_rows([2, 0])
    assert cache.batch == 2 and cache.lengths == [3, 1]
    assert cache.k[0][0].unique().tolist() == [2.0] and cache.k[0][1].unique().tolist() == [0.0]


def test_take_rows_copies_rows_and_leaves_the_cache_as_it_was():
    cache = KVCache(1, 3, 1, 4, 2)
    for r in range(3):
        cache.k[0][r] = r
        cache.set_length(r, r + 1)
    part = cache.take_rows([2, 0])
    assert (part.batch, part.lengths, part.capacity) == (2, [3, 1], 4)
    assert part.k[0][0].unique().tolist() == [2.0] and part.k[0][1].unique().tolist() == [0.0]
    part.k[0][0] = 9  # a copy: the source row is untouched
    assert cache.batch == 3 and cache.lengths == [1, 2, 3] and cache.k[0][2].unique().tolist() == [2.0]
    small = cache.take_rows([1, 0], 2)
    assert (small.capacity, small.k[0].shape[2], small.lengths) == (2, 2, [2, 1])
    with pytest.raises(ValueError, match="cannot take 2 slots"):
        cache.take_rows([2], 2)


@pytest.mark.parametrize("mode", ["dflash", "ar"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_requests_joining_a_running_batch(engine, mode, temperature):
    """In-flight batching: requests added between steps of a DecodeBatch (longer prompts and more
    tokens than the rows already there: the caches grow) decode exactly as they do alone."""
    from dflash_trt.runtime.decode_batch import DecodeBatch

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 95, (n,), generator=g).tolist() for n in (4, 30, 2, 7, 12)]
    params = [SamplingParams(temperature=temperature, max_tokens=m, seed=10 + i, ignore_eos=True)
              for i, m in enumerate((6, 40, 1, 9, 25))]
    alone = [engine.generate([p], [sp], mode)[0].token_ids for p, sp in zip(prompts, params)]
    batch = DecodeBatch(engine, mode)
    streamed: dict[int, list[int]] = {}

    def streamer(k):
        return lambda _, ids: streamed.setdefault(k, []).extend(ids)

    joins = {0: [0], 2: [1, 2], 3: [3], 5: [4]}  # step -> prompts added before it
    ids, done, steps = {}, {}, 0
    while steps <= max(joins) or batch.active:
        for k in joins.get(steps, []):
            ids[k] = batch.add([prompts[k]], [params[k]], streamer(k))[0]
        live = batch.active
        stats = batch.step()
        done.update(batch.take_finished())
        assert stats.requests == live and stats.emitted_tokens >= live
        steps += 1
    assert sorted(ids.values()) == [0, 1, 2, 3, 4]
    assert [done[ids[k]].token_ids for k in range(5)] == alone
    assert [streamed[k] for k in range(5)] == alone
    assert [done[ids[k]].metrics.completion_tokens for k in range(5)] == [6, 40, 1, 9, 25]
    assert batch.take_finished() == [] and batch.active == 0


def test_a_failed_add_leaves_the_batch_running(engine):
    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.runtime.decode_batch import DecodeBatch

    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = engine.generate([[5, 6, 7]], sp)[0].token_ids
    batch = DecodeBatch(engine)
    (first,) = batch.add([[5, 6, 7]], sp)
    batch.step()
    with pytest.raises(InvalidRequestError, match=r"^prompt 1 holds token id 500 \(at position 0\), outside"):
        batch.add([[1, 2], [500]], sp)
    assert batch.cache.batch == 1 and len(batch.live) == 1
    while batch.active:
        batch.step()
    assert dict(batch.take_finished())[first].token_ids == alone


def test_append_rows_grows_the_capacity():
    a, b = KVCache(2, 1, 1, 4, 2), KVCache(2, 2, 1, 6, 2)
    a.k[1][0] = 1.0
    a.set_length(0, 3)
    b.v[0][1] = 2.0
    b.set_length(1, 5)
    a.append_rows(b)
    assert (a.batch, a.capacity, a.lengths) == (3, 6, [3, 0, 5])
    assert a.k[1][0, :, :4].unique().tolist() == [1.0] and a.k[1][0, :, 4:].unique().tolist() == [0.0]
    assert a.v[0][2].unique().tolist() == [2.0] and a.v[0][1].unique().tolist() == [0.0]
    with pytest.raises(ValueError, match="cannot append"):
        a.append_rows(KVCache(3, 1, 1, 4, 2))


def test_a_row_failing_at_prefill_sends_no_token_of_any_row(engine, monkeypatch):
    """The first tokens of every new row are chosen before any is emitted: when one row's sampling fails
    (NaN probabilities), no caller has been sent a token, so the server can rerun the others alone."""
    import dflash_trt.runtime.engine as engine_module
    from dflash_trt.runtime.decode_batch import DecodeBatch

    def failing(probs, generator):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    monkeypatch.setattr(engine_module, "sample", failing)
    sent = []
    batch = DecodeBatch(engine)
    with pytest.raises(RuntimeError, match="nan"):
        batch.add([[5, 6], [7, 8]], [SamplingParams(max_tokens=4), SamplingParams(temperature=1.0, max_tokens=4)],
                  lambda k, ids: sent.append((k, ids)))
    assert sent == [] and batch.cache is None


@pytest.mark.parametrize("mode", ["dflash", "ar"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_prefill_decodes_as_a_whole_prefill(engine, mode, temperature, chunk):
    """Chunked prefill: requests joining a running batch have their prompts read `chunk` positions per
    step (a row whose prompt ended leaves the later chunks) and decode exactly as alone with one whole
    prefill; the running requests decode one step per chunk meanwhile; the iteration stats count each
    prompt token once."""
    from dflash_trt.runtime.decode_batch import DecodeBatch

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 95, (n,), generator=g).tolist() for n in (4, 30, 2, 7, 12, 1)]
    params = [SamplingParams(temperature=temperature, max_tokens=m, seed=20 + i, ignore_eos=True)
              for i, m in enumerate((80, 6, 1, 9, 25, 3))]
    alone = [engine.generate([p], [sp], mode)[0].token_ids for p, sp in zip(prompts, params)]
    batch = DecodeBatch(engine, mode, prefill_chunk=chunk)
    streamed: dict[int, list[int]] = {}
    joins = {0: [0], 2: [1, 2], 3: [3], 9: [4, 5]}  # step -> prompts added before it, one add call each
    ids, done, stats, first_out, active = {}, {}, [], [], []
    while len(stats) <= max(joins) or batch.active:
        for k in joins.get(len(stats), []):
            ids[k] = batch.add([prompts[k]], [params[k]], lambda _, t, k=k: streamed.setdefault(k, []).extend(t))[0]
        active.append(len(set(ids.values()) - set(done)))
        stats.append(batch.step())
        done.update(batch.take_finished())
        first_out.append(len(streamed.get(0, [])))
    assert [done[ids[k]].token_ids for k in range(6)] == alone
    assert [streamed[k] for k in range(6)] == alone
    assert sum(s.context_tokens for s in stats) == sum(map(len, prompts))
    # one add call's prompt per step (each prompt is its own call here), in order: ceil(n / chunk) steps
    # each; request 0, once it runs, decodes in every one of them
    assert all(s.context_tokens <= chunk and s.context_requests <= 1 for s in stats)
    reading = [j for j, s in enumerate(stats) if s.context_requests]
    assert len(reading) == sum(-(-len(p) // chunk) for p in prompts)
    # request 0's last chunk and first decode step share an iteration: one scheduled request, not two
    joined = stats[-(-4 // chunk) - 1]
    assert (joined.context_requests, joined.requests, joined.scheduled_requests) == (1, 1, 1)
    assert all(s.scheduled_requests <= s.context_requests + s.requests for s in stats)
    # active: every request added and not finished before the iteration (TensorRT-LLM's numActiveRequests:
    # those waiting for their prompt's next chunk count too)
    assert [s.active_requests for s in stats] == active
    assert any(s.active_requests > s.scheduled_requests for s in stats)
    assert all(first_out[j] > first_out[j - 1] for j in reading if 0 < first_out[j - 1] < 80)
    assert sum(1 for j in reading if 0 < first_out[j - 1] < 80) >= 30 // chunk
    assert done[ids[1]].metrics.prompt_tokens == 30 and done[ids[1]].metrics.time_to_first_token_s > 0
    assert batch.active == 0 and batch.take_finished() == []


@pytest.mark.parametrize("mode", ["dflash", "ar"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_short_prompt_does_not_wait_for_a_long_one_added_with_it(engine, mode, temperature):
    """Chunked prefill, one add call with prompts of 3, 40 and 9 tokens (chunks of 4): each request emits
    its first token in the step that reads its prompt's end and decodes from the next step on, while the
    40-token prompt is still being read; every output equals the request alone."""
    from dflash_trt.runtime.decode_batch import DecodeBatch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 95, (n,), generator=g).tolist() for n in (3, 40, 9)]
    params = [SamplingParams(temperature=temperature, max_tokens=m, seed=30 + i, ignore_eos=True)
              for i, m in enumerate((20, 5, 20))]
    alone = [engine.generate([p], [sp], mode)[0].token_ids for p, sp in zip(prompts, params)]
    batch = DecodeBatch(engine, mode, prefill_chunk=4)
    streamed: dict[int, list[int]] = {}
    ids = batch.add(prompts, params, lambda k, t: streamed.setdefault(k, []).extend(t))
    counts, done, capacity = [], {}, []
    while batch.active:
        batch.step()
        done.update(batch.take_finished())
        counts.append([len(streamed.get(k, [])) for k in range(3)])
        capacity.append(batch.cache.capacity if batch.cache is not None else 0)
    assert [done[i].token_ids for i in ids] == alone and [streamed[k] for k in range(3)] == alone
    # the running batch's cache holds what its requests can write, not the long prompt's slots (until it joins)
    assert capacity[0] == 3 + 20 + batch.block + 1 and capacity[2] == 9 + 20 + batch.block + 1
    first = [next(j for j, c in enumerate(counts) if c[k]) for k in range(3)]
    assert first == [0, 9, 2]  # the steps reading each prompt's last chunk: ceil(n / 4) - 1
    assert counts[1][0] > 1 and counts[3][2] > 1  # they decode while the long prompt is read
    assert done[ids[0]].metrics.time_to_first_token_s < done[ids[2]].metrics.time_to_first_token_s \
        < done[ids[1]].metrics.time_to_first_token_s


def test_a_failed_chunk_drops_only_its_requests(engine, monkeypatch):
    """A chunked prefill that fails inside step() raises PrefillFailed naming the requests added together,
    which leave the batch without having sent a token; the running request goes on to its own output."""
    import dflash_trt.runtime.engine as engine_module
    from dflash_trt.runtime.decode_batch import DecodeBatch, PrefillFailed

    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = engine.generate([[5, 6, 7]], sp)[0].token_ids
    batch = DecodeBatch(engine, prefill_chunk=2)
    (first,) = batch.add([[5, 6, 7]], sp)
    while not batch.live:
        batch.step()
    sent = []

    def failing(probs, generator):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    monkeypatch.setattr(engine_module, "sample", failing)
    bad = batch.add([[9, 10, 11], [12]], [sp, SamplingParams(temperature=1.0, max_tokens=4)],
                    lambda k, ids: sent.append((k, ids)))
    assert batch.active == 3
    with pytest.raises(PrefillFailed, match="nan") as info:
        batch.step()  # positions 0-1: [12] is read and would join at once, but its sampled first token fails
    assert info.value.request_ids == bad and "nan" in str(info.value.error) and sent == []
    monkeypatch.undo()
    assert batch.active == 1 and batch.cache.batch == 1
    while batch.active:
        batch.step()
    result = dict(batch.take_finished())
    assert list(result) == [first] and result[first].token_ids == alone


@pytest.mark.parametrize("chunk", [0, -3, True, 2.5, "4"])
def test_prefill_chunk_must_be_a_whole_number(engine, chunk):
    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.runtime.decode_batch import DecodeBatch

    with pytest.raises(InvalidRequestError, match="prefill_chunk must be a whole number of tokens >= 1"):
        DecodeBatch(engine, prefill_chunk=chunk)


def test_abort_prefill_ends_requests_before_their_prompts_are_read(engine):
    """Chunked prefill: requests whose prompts are still waiting to be read end at once with "abort" and no
    tokens (a client gone, Ctrl-C): their rows leave their add call's prefill, which goes on for the others;
    their metrics count the prompt tokens read so far."""
    from dflash_trt.runtime.decode_batch import DecodeBatch

    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    a, b, c = list(range(3, 43)), list(range(5, 25)), list(range(7, 37))
    batch = DecodeBatch(engine, prefill_chunk=4)
    sent = []
    pair = batch.add([a, b], sp, lambda k, ids: sent.append(k))
    (lone,) = batch.add([c], sp, lambda k, ids: sent.append("lone"))
    batch.step()  # 4 tokens of a and b
    assert batch.abort_prefill([pair[0], 99]) == 1 and batch.active == 2  # a leaves, b is read on
    assert batch.abort_prefill([lone]) == 1 and batch.active == 1  # c leaves unread: its call is gone
    ended = [(i, r.token_ids, r.finish_reason, r.metrics.prompt_tokens) for i, r in batch.take_finished()]
    assert ended == [(pair[0], [], "abort", 4), (lone, [], "abort", 0)]
    while batch.active:
        batch.step()
    done = dict(batch.take_finished())
    assert list(done) == [pair[1]] and done[pair[1]].token_ids == engine.generate([b], sp)[0].token_ids
    assert set(sent) == {1}


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_the_caches_shrink_to_what_the_requests_left_need(engine, mode):
    """When the request needing the most KV slots leaves, the batch's target and drafter caches keep only
    the slots the others can still write (prompt + max_tokens + a block + 1 each); outputs are unchanged."""
    from dflash_trt.runtime.decode_batch import DecodeBatch

    prompts, budgets = [list(range(3, 63)), [7, 8, 9]], [6, 30]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in budgets]
    alone = [engine.generate([p], [sp], mode)[0].token_ids for p, sp in zip(prompts, params)]
    batch = DecodeBatch(engine, mode)
    ids = batch.add(prompts, params)
    block = batch.block
    caches = [c for c in (batch.cache, batch._drafter_cache) if c is not None]
    assert [c.capacity for c in caches] == [60 + 6 + block + 1] * len(caches)
    done, shrunk = {}, 0
    while batch.active:
        long_left = ids[0] in done  # its rows are dropped at the start of the next step
        batch.step()
        if long_left:
            caches = [c for c in (batch.cache, batch._drafter_cache) if c is not None]
            assert [(c.capacity, c.buffer.shape[4], c.batch) for c in caches] == [(3 + 30 + block + 1,) * 2 + (1,)] * len(caches)
            shrunk += 1
        done.update(batch.take_finished())
    assert shrunk and [done[i].token_ids for i in ids] == alone


def test_keep_rows_refuses_to_cut_a_rows_committed_slots():
    cache = KVCache(1, 2, 1, 8, 2)
    cache.set_length(0, 6)
    cache.set_length(1, 2)
    with pytest.raises(ValueError, match="cannot keep 4 slots"):
        cache.keep_rows([0, 1], 4)
    cache.keep_rows([1], 4)
    assert (cache.batch, cache.capacity, cache.lengths, cache.k[0].shape[2]) == (1, 4, [2], 4)


@pytest.mark.parametrize("mode", ["dflash", "ar"])
@pytest.mark.parametrize("chunk", [None, 3])
def test_identical_prompts_are_read_once(engine, mode, chunk, monkeypatch):
    """Rows with the same prompt (a request's n choices) are prefilled by one row's forward, the others get
    copies of its K/V, drafter context and first-token logits; every output equals its request alone."""
    from dflash_trt.runtime.decode_batch import DecodeBatch

    p, q = [11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 42, 43, 44]
    prompts = [p, q, p, p]
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in (1, 2, 3)]
    alone = [engine.generate([x], [sp], mode)[0].token_ids for x, sp in zip(prompts, params)]
    rows = []
    forward = engine.target.forward
    monkeypatch.setattr(engine.target, "forward", lambda ids, *a, **k: rows.append(ids.shape[0]) or forward(ids, *a, **k))
    batch = DecodeBatch(engine, mode, chunk)
    ids = batch.add(prompts, params)
    while batch.active:
        batch.step()
    done = dict(batch.take_finished())
    assert [done[i].token_ids for i in ids] == alone
    assert rows[: 1 if chunk is None else 3] == ([2] if chunk is None else [2, 2, 1])  # p and q, then p's last chunk
    assert alone[2] != alone[3]  # the sampled choices of one prompt still differ


def test_an_iterations_latency_includes_the_prefill_it_reports(engine, monkeypatch):
    """TensorRT-LLM's iteration latency covers the context phase: the prefill `add` ran (a whole prefill, here made
    to last >= 0.2 s) is in the next iteration's seconds, the one whose context_tokens count it, and in
    `flush_stats` when no step follows; an iteration without prefill does not carry it again."""
    import time

    from dflash_trt.runtime.decode_batch import DecodeBatch

    real = engine._prefill

    def slow(*args, **kwargs):
        time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "_prefill", slow)
    batch = DecodeBatch(engine, "ar")
    batch.add([[5, 6, 7]], [SamplingParams(max_tokens=3, ignore_eos=True)])
    first = batch.step()
    assert first.context_tokens == 3 and first.seconds >= 0.2
    second = batch.step()
    assert second.context_tokens == 0 and second.seconds < 0.2
    batch.add([[8, 9]], [SamplingParams(max_tokens=1)])  # ends at its first token: no step follows
    flushed = batch.flush_stats()
    assert flushed.context_tokens == 2 and flushed.seconds >= 0.2 and batch.flush_stats() is None


@pytest.mark.parametrize("take_early", [False, True])
def test_each_finished_request_is_counted_complete_in_exactly_one_iteration(engine, take_early):
    """StepStats.completed_requests (TensorRT-LLM's numCompletedRequests): requests ending in a decode step (in the
    step that ends them), at their first token (in the next iteration, or `flush_stats`), aborted while their prompt
    waits for a chunk, each once, whether their results are taken at once (the server does) or later."""
    from dflash_trt.runtime.decode_batch import DecodeBatch

    batch = DecodeBatch(engine, "ar", prefill_chunk=4)
    taken = []

    def stats(s):
        if take_early:
            taken.extend(batch.take_finished())
        return s

    batch.add([[5, 6, 7]], [SamplingParams(max_tokens=3, ignore_eos=True)])  # ends in a step
    batch.add([[8, 9]], [SamplingParams(max_tokens=1)])  # ends at its first token
    [late] = batch.add([list(range(3, 30))], [SamplingParams(max_tokens=4, ignore_eos=True)])  # aborted mid-prompt
    got = [stats(batch.step()).completed_requests]
    assert batch.abort_prefill([late]) == 1
    while batch.active:
        got.append(stats(batch.step()).completed_requests)
    flushed = batch.flush_stats()
    assert flushed is None or flushed.completed_requests == 0
    taken.extend(batch.take_finished())
    assert sum(got) == 3 == len(taken) and got[0] == 0  # the first step read prompts, finished none
    assert batch.flush_stats() is None
    whole = DecodeBatch(engine, "ar")  # prefilled in add: a batch whose only request ends at its first token
    whole.add([[8, 9]], [SamplingParams(max_tokens=1)])
    if take_early:
        assert len(whole.take_finished()) == 1
    flushed = whole.flush_stats()
    assert (flushed.completed_requests, flushed.context_tokens) == (1, 2) and whole.flush_stats() is None


def test_non_finite_draft_probabilities_are_an_error_naming_the_drafter(engine, monkeypatch):
    """A drafter whose activations overflow gives NaN draft logits: a sampled request gets a clear error (it used to
    be torch.multinomial's "probability tensor contains either inf, nan or element < 0")."""
    from dflash_trt.errors import DFlashError

    proposer = engine.proposer
    real = proposer._draft_logits
    monkeypatch.setattr(proposer, "_draft_logits", lambda hidden: real(hidden) * float("nan"))
    monkeypatch.setattr(proposer, "draft_confidence", 0.0)
    monkeypatch.setattr(proposer, "sampled_draft_confidence", 0.0)
    with pytest.raises(DFlashError, match="the drafter produced non-finite draft probabilities"):
        engine.generate([[5, 6, 7]], [SamplingParams(temperature=1.0, max_tokens=8, seed=0, ignore_eos=True)], "dflash")


def test_acceptance_per_position_has_one_count_per_draft_position_from_the_start(engine):
    """A request that ends at its first token (no verify step) reports max_draft_len zeros, as every other
    DFlash request reports max_draft_len counts (`--json`'s accepted_per_position had [] then); ar reports none."""
    k = engine.proposer.max_draft_len
    [one] = engine.generate([[5, 6, 7]], [SamplingParams(max_tokens=1)], "dflash")
    [more] = engine.generate([[5, 6, 7]], [SamplingParams(max_tokens=9, ignore_eos=True)], "dflash")
    [ar] = engine.generate([[5, 6, 7]], [SamplingParams(max_tokens=9, ignore_eos=True)], "ar")
    assert one.metrics.accepted_per_position == [0] * k and one.metrics.verify_steps == 0
    assert len(more.metrics.accepted_per_position) == k and more.metrics.verify_steps > 0
    assert ar.metrics.accepted_per_position == []


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_on_finished_hands_out_each_result_as_its_request_ends(engine, mode):
    """`on_finished(prompt_index, result)` is called once per request, as it ends (a shorter request before a longer
    one, one ending at its first token too), with the very result generate returns for it; while it runs, the longer
    requests have not ended yet."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 95, (n,), generator=g).tolist() for n in (4, 9, 6)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 1, 7)]
    seen, streamed = [], {0: 0, 1: 0, 2: 0}

    def tokens(i, toks, *rest):
        streamed[i] += len(toks)

    def finished(i, res):
        seen.append((i, res, dict(streamed)))

    results = engine.generate(prompts, params, mode, tokens, on_finished=finished)
    assert [i for i, _, _ in seen] == [1, 2, 0]  # in the order they end: at the prefill, after 7 tokens, after 20
    assert all(res is results[i] for i, res, _ in seen)
    assert seen[1][2][0] < 20 and seen[1][2][2] == 7  # prompt 0 still decoding when prompt 2's result came
    assert [r.token_ids for r in results] == [engine.generate([p], [sp], mode)[0].token_ids
                                              for p, sp in zip(prompts, params)]
