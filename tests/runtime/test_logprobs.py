"""Log-probabilities of emitted tokens: the target's raw distribution, the same in DFlash and autoregressive
decoding, checked against a Hugging Face forward over the whole output (teacher forcing)."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.config import TargetConfig
from dflash_trt.errors import InvalidRequestError
from dflash_trt.models.checkpoints import init_drafter, load_drafter, load_target, new_drafter_config
from dflash_trt.runtime.decode_batch import DecodeBatch
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.logprobs import MAX_LOGPROBS, token_logprobs
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams
from tests.conftest import make_hf_model
from tests.runtime.oracle import OracleProposer

TOL = 1e-4  # float32: a 16-row verify and a 1-row step round their logits differently in the last bits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("logprobs")
    hf, folder = make_hf_model(tmp, "llama", vocab=96, seed=3)
    target = load_target(folder)
    dcfg = new_drafter_config(TargetConfig.from_pretrained(folder), 1, 4, 95, [1, 3])
    drafter = load_drafter(init_drafter(dcfg, tmp / "d", seed=1))
    return hf, target, Engine(target, DFlashProposer(drafter, target))


def reference(hf, prompt: list[int], out: list[int]) -> torch.Tensor:
    """[len(out), V] log-softmax of HF's logits at the positions that predicted each output token."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(out) - 1], -1)


def check(result, ref: torch.Tensor, num_top: int) -> None:
    """`result.logprobs` match the reference distributions `ref` [len(out), V]: the chosen token's value
    and the top `num_top` alternatives, most likely first."""
    lps = result.logprobs
    assert [lp.token_id for lp in lps] == result.token_ids
    for lp, row in zip(lps, ref):
        assert abs(lp.logprob - float(row[lp.token_id])) < TOL
        values, ids = row.topk(num_top)
        assert len(lp.top) == num_top
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=TOL)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        # ids agree except where two alternatives are within rounding of each other
        for (i, v), ri in zip(lp.top, ids.tolist()):
            assert i == ri or abs(float(row[i]) - v) < TOL


def test_token_logprobs_is_log_softmax_and_topk():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    out = token_logprobs(logits, [0, 2], 2)
    ref = torch.log_softmax(logits, -1)
    assert out[0].token_id == 0 and out[0].logprob == pytest.approx(float(ref[0, 0]))
    assert [i for i, _ in out[0].top] == [2, 1]
    assert out[1].logprob == pytest.approx(float(ref[1, 2]))
    assert {i for i, _ in out[1].top} == {0, 1}  # a tie: both of the largest
    assert token_logprobs(logits, [1, 1], 0)[0].top == ()
    assert token_logprobs(logits[:0], [], 3) == []


@pytest.mark.parametrize("mode", ["dflash", "ar"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_targets_raw_distribution(tiny, mode, temperature):
    hf, _, engine = tiny
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 95, (n,), generator=g).tolist() for n in (5, 12, 2)]
    params = [SamplingParams(temperature=temperature, max_tokens=m, seed=i, ignore_eos=True, logprobs=k)
              for i, (m, k) in enumerate(((9, 3), (20, 0), (1, MAX_LOGPROBS)))]
    results = engine.generate(prompts, params, mode)
    for p, sp, r in zip(prompts, params, results):
        assert len(r.logprobs) == len(r.token_ids) == sp.max_tokens
        ref = reference(hf, p, r.token_ids)
        check(r, ref, sp.logprobs)
        if sp.greedy:  # the argmax: each token's logprob is its distribution's largest
            assert all(abs(lp.logprob - float(row.max())) < TOL for lp, row in zip(r.logprobs, ref))
    # asking for logprobs does not change the output
    plain = engine.generate(prompts, [SamplingParams(temperature=temperature, max_tokens=sp.max_tokens, seed=sp.seed,
                                                     ignore_eos=True) for sp in params], mode)
    assert [r.token_ids for r in plain] == [r.token_ids for r in results]
    assert all(r.logprobs is None for r in plain)


@pytest.mark.parametrize("wrong", [(), (2,), (1,)])
def test_accepted_drafts_get_the_verify_pass_logprobs(tiny, wrong):
    """An oracle drafts the greedy continuation (every draft accepted, or cut at a wrong draft): the
    logprobs of accepted drafts, corrections and bonus tokens all equal the autoregressive ones."""
    hf, target, engine = tiny
    prompt = [5, 17, 33, 8, 61]
    ar = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, logprobs=4), "ar")[0]
    oracle = Engine(target, OracleProposer([prompt + ar.token_ids], 4, wrong, vocab_size=96))
    res = oracle.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, logprobs=4), "dflash")[0]
    assert res.token_ids == ar.token_ids
    assert (res.metrics.accepted_tokens > 0) == (wrong != (1,))  # a wrong first draft: corrections only
    for a, b in zip(res.logprobs, ar.logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < TOL
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
    check(res, reference(hf, prompt, res.token_ids), 4)


def counted_rows(monkeypatch, target) -> list[int]:
    """Wrap target.compute_logits to record how many rows each lm_head product computes."""
    rows, head = [], target.compute_logits

    def counting(hidden):
        rows.append(hidden.shape[0])
        return head(hidden)

    monkeypatch.setattr(target, "compute_logits", counting)
    return rows


@pytest.mark.parametrize("case", ["oracle chain", "tree", "sampled"])
def test_logprobs_reuse_the_verifiers_logits(tiny, monkeypatch, case):
    """Logprobs are read from the logits the verifier computed: asking for them adds no lm_head row (a
    chain whose drafts are accepted, so the lazy verifier's second product runs too; a draft tree; a
    sampled request), and their values are still the reference's."""
    hf, target, engine = tiny
    prompt = [5, 17, 33, 8, 61]
    temperature = 1.0 if case == "sampled" else 0.0
    if case == "oracle chain":
        ar = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True), "ar")[0]
        engine = Engine(target, OracleProposer([prompt + ar.token_ids], 4, (3,), vocab_size=96), lazy_logits=2)
    elif case == "tree":
        engine = Engine(target, DFlashProposer(engine.proposer.drafter, target, tree_topk=3))
    rows = counted_rows(monkeypatch, target)

    def run(k):
        params = SamplingParams(temperature=temperature, max_tokens=24, seed=7, ignore_eos=True, logprobs=k)
        rows.clear()
        result = engine.generate([prompt], params, "dflash")[0]
        return result, list(rows)

    plain, plain_rows = run(None)
    with_lp, lp_rows = run(5)
    assert with_lp.token_ids == plain.token_ids
    assert lp_rows == plain_rows
    if case == "oracle chain":  # drafts were accepted past the lazy verifier's first 2 positions
        assert with_lp.metrics.accepted_tokens > 0 and len(plain_rows) > with_lp.metrics.verify_steps
    check(with_lp, reference(hf, prompt, with_lp.token_ids), 5)


def test_logprobs_end_with_the_output_at_a_stop_and_stream_with_it(tiny):
    hf, target, engine = tiny
    prompt = [9, 4, 71]
    ar = engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True), "ar")[0].token_ids
    stop = ar[6]
    oracle = Engine(target, OracleProposer([prompt + ar], 4, vocab_size=96))
    streamed = []
    res = oracle.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=(stop,), logprobs=1), "dflash",
                          on_tokens=lambda i, ids, lps: streamed.append((ids, lps)))[0]
    assert res.finish_reason == "stop" and res.token_ids == ar[: ar.index(stop) + 1]
    assert len(res.logprobs) == len(res.token_ids)
    assert [t for ids, _ in streamed for t in ids] == res.token_ids
    assert [lp for _, lps in streamed for lp in lps] == res.logprobs
    assert all(len(ids) == len(lps) for ids, lps in streamed)


def test_a_request_joining_a_batch_and_chunked_prefill_keep_their_logprobs(tiny):
    hf, _, engine = tiny
    prompts = [[3, 50, 7, 12, 90, 14, 2, 66], [40, 41]]
    batch = DecodeBatch(engine, "dflash", prefill_chunk=3)
    batch.add([prompts[0]], SamplingParams(max_tokens=12, ignore_eos=True))
    batch.step()
    batch.add([prompts[1]], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2))
    while batch.active:
        batch.step()
    done = dict(batch.take_finished())
    assert done[0].logprobs is None
    check(done[1], reference(hf, prompts[1], done[1].token_ids), 2)


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.0, True, "3"])
def test_logprobs_out_of_range_are_refused(value):
    with pytest.raises(InvalidRequestError, match="logprobs must be"):
        SamplingParams(logprobs=value)


@pytest.mark.slow
def test_smollm2_tree_and_prompt_lookup_logprobs_equal_autoregressive(smollm2_pipeline):
    """The real model and drafter with the CPU's drafting (trees of top-4, prompt-lookup candidates, a
    confidence threshold): accepted off-chain tree paths read their logprobs at the right nodes."""
    pipe = smollm2_pipeline
    target, drafter = pipe.engine.target, pipe.engine.proposer.drafter
    engine = Engine(target, DFlashProposer(drafter, target, draft_confidence=0.2, tree_topk=4, prompt_lookup=4))
    prompts = [pipe.encode_chat(c) for c in ("Write a Python function that adds two numbers.",
                                             "List the days of the week.")]
    params = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=5)
    ar = pipe.engine.generate(prompts, params, "ar")
    for p, a in zip(prompts, ar):
        d = engine.generate([p], params)[0]
        assert d.token_ids == a.token_ids and d.metrics.accepted_tokens > 0
        for x, y in zip(d.logprobs, a.logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-3
            assert [i for i, _ in x.top[:2]] == [i for i, _ in y.top[:2]]


def prompt_reference(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V] log-softmax of HF's logits predicting prompt tokens 1 .. n - 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), -1)


@pytest.mark.parametrize("chunk", [None, 1, 4])
def test_prompt_logprobs_whole_chunked_and_for_repeated_prompts(tiny, monkeypatch, chunk):
    """Prompt logprobs (the first token has none) equal a Hugging Face forward over the prompt, read in one
    prefill, in chunks of 1 or 4 positions, and with the lm_head in pieces of 3 rows; a prompt repeated in
    the batch (read once) gets them too, and one asking for fewer alternatives is read on its own."""
    import dflash_trt.runtime.engine as engine_module

    hf, _, engine = tiny
    monkeypatch.setattr(engine_module, "PROMPT_LOGITS_ROWS", 3)
    prompt = [7, 3, 88, 41, 12, 5, 60, 19, 2, 33, 71]
    ref = prompt_reference(hf, prompt)
    params = [SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=k, logprobs=l)
              for k, l in ((2, None), (2, 1), (0, None), (None, None))]
    batch = DecodeBatch(engine, "dflash", prefill_chunk=chunk)
    calls: list[tuple[int, tuple]] = []
    batch.add([prompt] * 4, params, lambda k, ids, *more: calls.append((k, more)))
    while batch.active:
        batch.step()
    done = [r for _, r in sorted(batch.take_finished())]
    for k, r in enumerate(done):  # on_tokens: the prompt's logprobs at a request's first call only
        extra = [more for i, more in calls if i == k]
        assert len(extra) >= 2
        if r.prompt_logprobs is None:
            assert all(more == () for more in extra)
            continue
        assert extra[0][1] == r.prompt_logprobs and (extra[0][0] is None) == (params[k].logprobs is None)
        assert all(len(more) == (0 if params[k].logprobs is None else 1) for more in extra[1:])
    for r, sp in zip(done[:3], params):
        lps = r.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        assert [lp.token_id for lp in lps[1:]] == prompt[1:]
        for lp, row, tok in zip(lps[1:], ref, prompt[1:]):
            assert abs(lp.logprob - float(row[tok])) < TOL and len(lp.top) == sp.prompt_logprobs
            assert [v for _, v in lp.top] == pytest.approx(row.topk(sp.prompt_logprobs).values.tolist(), abs=TOL)
    assert done[3].prompt_logprobs is None and done[0].logprobs is None and len(done[1].logprobs) == 3
    assert len({tuple(r.token_ids) for r in done}) == 1  # greedy: the same answer for all four
