"""Logits processing (logit_bias, repetition / presence / frequency penalties, min_tokens, min_p) is exact under
speculative decoding: each verify position is processed with its own history (prompt + output + the drafts
before it), so DFlash (chains and trees) gives Hugging Face `generate`'s greedy tokens with the same processors,
and keeps the sampled distribution; a history that forgets the drafts is caught by the same tests."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import dflash_trt.runtime.engine as engine_mod
from dflash_trt.errors import InvalidRequestError
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.penalties import LogitsPenalties, chain_prefixes, tree_prefixes
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams, probs_from_logits
from tests.runtime.oracle import OracleProposer
from tests.runtime.test_sampling_distribution import (  # noqa: F401 (tiny: a fixture)
    PROMPT, VOCAB, exact_joint, scaled_pvalue_and_rate, tiny)

MAX_TOKENS = 32
CHATS = ["Write a Python function that reverses a string.", "Name three colours."]
SHORT_CHAT = "What is the capital of France?"  # the plain greedy answer ends (EOS) after 8 tokens


class OutputPenalties(LogitsProcessor):
    """OpenAI's presence / frequency penalties over the generated tokens (the reference: HF has none)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for b in range(input_ids.shape[0]):
            counts = torch.bincount(input_ids[b, self.prompt_len:], minlength=scores.shape[-1]).float()
            scores[b] = scores[b] - self.frequency * counts - self.presence * (counts > 0).float()
        return scores


class Bias(LogitsProcessor):
    def __init__(self, bias: dict[int, float]):
        self.bias = bias

    def __call__(self, input_ids, scores):
        for t, b in self.bias.items():
            scores[:, t] += b
        return scores


class BadWordsInOutput(LogitsProcessor):
    """vLLM's bad words over the generated tokens (the reference: HF's NoBadWordsLogitsProcessor reads the prompt
    too): a word's last token gets -inf where the output ends with the rest of it."""

    def __init__(self, prompt_len: int, words):
        self.prompt_len, self.words = prompt_len, words

    def __call__(self, input_ids, scores):
        for b in range(input_ids.shape[0]):
            out = input_ids[b, self.prompt_len:].tolist()
            for w in self.words:
                if len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == list(w[:-1]):
                    scores[b, w[-1]] = float("-inf")
        return scores


def hf_processors(params: SamplingParams, prompt_len: int, stop_ids) -> LogitsProcessorList:
    """HF's processors for `params`, in our order (logit bias, repetition, presence / frequency, min_tokens, bad
    words)."""
    procs = []
    if params.logit_bias:
        procs.append(Bias(dict(params.logit_bias)))
    if params.repetition_penalty != 1:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        start = prompt_len if params.prompt_ignore_length is None else min(params.prompt_ignore_length, prompt_len)
        procs.append(OutputPenalties(start, params.presence_penalty, params.frequency_penalty))
    if params.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_tokens, list(stop_ids)))
    if params.bad_words:  # TensorRT-LLM's scope (the prompt read too) is HF's own
        procs.append(NoBadWordsLogitsProcessor([list(w) for w in params.bad_words]) if params.bad_words_read_prompt
                     else BadWordsInOutput(prompt_len, params.bad_words))
    return LogitsProcessorList(procs)


# ---------------------------------------------------------------------------------------------- unit level

def test_prefixes_of_chains_and_trees():
    assert chain_prefixes([7, 8, 9], 0, 4) == [[], [7], [7, 8], [7, 8, 9]]
    assert chain_prefixes([7, 8, 9], 2, 4) == [[7, 8], [7, 8, 9]]
    # nodes 1 (10) and 3 (11) under the root, 2 (20) under 1, 4 (21) under 3
    assert tree_prefixes([10, 20, 11, 21], [0, 1, 0, 3], 5) == [[], [10], [10, 20], [11], [11, 21]]


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=1.7), SamplingParams(repetition_penalty=0.6),
    SamplingParams(presence_penalty=1.5, frequency_penalty=-0.4),
    SamplingParams(logit_bias={3: 2.5, 40: -100.0}),
    SamplingParams(min_tokens=6, max_tokens=10),
    SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={5: 1.0},
                   min_tokens=5, max_tokens=10),
    SamplingParams(presence_penalty=1.5, frequency_penalty=-0.4, prompt_ignore_length=2),
    SamplingParams(presence_penalty=0.5, prompt_ignore_length=0, repetition_penalty=1.2),
    SamplingParams(frequency_penalty=0.5, prompt_ignore_length=99),
    # one-token words; words whose rest ends the output (5), spans output and drafts (9 5 17), lies in the drafts
    # (17 3), or only in the prompt (12 40: not matched); a word longer than the history
    SamplingParams(bad_words=[[2], [61], [5, 8], [9, 5, 17, 30], [17, 3, 11], [12, 40, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]),
    SamplingParams(bad_words=[[3, 3]], logit_bias={3: 5.0}, min_tokens=6, max_tokens=10),
    # TensorRT-LLM's scope: words beginning in the prompt (12 40 5 9 5 17 | 33 at the first position, 9 12 40 ... 17 3
    # | 44 through the drafts), one whose rest is the prompt's end only (12 40: not at any position), the ones above
    SamplingParams(bad_words=[[12, 40, 5, 9, 5, 17, 33], [9, 12, 40, 5, 9, 5, 17, 17, 3, 44], [12, 40, 7], [5, 8],
                              [17, 3, 11], [2]], bad_words_read_prompt=True),
], ids=["rep", "rep<1", "presence-frequency", "bias", "min_tokens", "all", "prompt-from-2", "prompt-whole-rep",
        "prompt-beyond", "bad-words", "bad-words-bias", "bad-words-read-prompt"])
def test_each_position_equals_hf_processors_on_its_own_history(params):
    gen = torch.Generator().manual_seed(0)
    vocab, prompt, out, drafts = 64, [3, 9, 9, 12, 40], [5, 9, 5, 17], [17, 3, 3, 60]
    stop = frozenset({17, 63})
    logits = torch.randn(len(drafts) + 1, vocab, generator=gen) * 4
    ours = LogitsPenalties(params, prompt, stop).apply(logits, out, chain_prefixes(drafts, 0, len(drafts) + 1))
    procs = hf_processors(params, len(prompt), stop)
    for i in range(len(drafts) + 1):
        ids = torch.tensor([prompt + out + drafts[:i]])
        ref = procs(ids, logits[i : i + 1].clone())[0]
        assert torch.equal(ours[i], ref), i
    assert not torch.equal(ours, logits)  # it did something
    if params.bad_words_read_prompt:  # the words that begin in the prompt are banned only where it is read
        assert ours[0, 33] == ours[2, 44] == float("-inf")
        output_only = LogitsPenalties(dataclasses.replace(params, bad_words_read_prompt=False), prompt, stop).apply(
            logits, out, chain_prefixes(drafts, 0, len(drafts) + 1))
        assert output_only[0, 33] == logits[0, 33] and output_only[2, 44] == logits[2, 44]


def test_min_p_equals_hf_min_p_after_temperature_and_top_k():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(1)) * 3
    for min_p in (0.05, 0.3, 1.0):
        params = SamplingParams(temperature=0.7, top_k=20, min_p=min_p)
        ref = logits.clone()
        for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), MinPLogitsWarper(min_p)):
            ref = warper(None, ref)
        torch.testing.assert_close(probs_from_logits(logits, params), torch.softmax(ref, -1), atol=1e-6, rtol=1e-5)
    kept = (probs_from_logits(logits, SamplingParams(temperature=1.0, min_p=0.3)) > 0).sum(-1)
    assert (kept < (probs_from_logits(logits, SamplingParams(temperature=1.0)) > 0).sum(-1)).all()


@pytest.mark.parametrize("kw, message", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2] (0 = off), got 2.5"),
    (dict(frequency_penalty="1"), "frequency_penalty must be a number in [-2, 2] (0 = off), got '1' (str)"),
    (dict(repetition_penalty=0), "repetition_penalty must be finite and > 0 (1 = off), got 0.0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be finite and > 0"),
    (dict(logit_bias={-1: 1.0}), "the key -1 is not a token id"),
    (dict(logit_bias={"5": 1.0}), "the key '5' is not a token id"),
    (dict(logit_bias={5: 101}), "logit_bias[5] must be in [-100, 100], got 101.0"),
    (dict(logit_bias={5: float("nan")}), "logit_bias[5] must be in [-100, 100], got nan"),
    (dict(logit_bias=[5]), "logit_bias must be a mapping"),
    (dict(min_tokens=9, max_tokens=8), "min_tokens must be in [0, max_tokens = 8], got 9"),
    (dict(min_tokens=1.0), "min_tokens must be an integer >= 0 (0 = off), got 1.0 (float)"),
    (dict(min_p=1.5), "min_p must be in [0, 1] (0 = off), got 1.5"),
    (dict(prompt_ignore_length=-1), "prompt_ignore_length must be >= 0 (0: the whole prompt counts"),
    (dict(prompt_ignore_length=True), "prompt_ignore_length must be None or an integer >= 0, got True"),
    (dict(bad_words="no"), "bad_words must be a list of token id sequences (non-empty lists of integers >= 0), or None"),
    (dict(bad_words=[[]]), "; [] is not one"),
    (dict(bad_words=[[1, -2]]), "; [1, -2] is not one"),
    (dict(bad_words=[5]), "; 5 is not a sequence of token ids"),
    (dict(bad_words=[["a"]]), "; ['a'] is not one"),
    (dict(bad_words_read_prompt=1), "bad_words_read_prompt must be True or False, got 1"),
])
def test_bad_values_are_named(kw, message):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kw)
    assert message in str(info.value)


def test_bad_words_are_normalized_checked_against_the_vocabulary_and_made_from_words(smollm2_pipeline):
    from dflash_trt.runtime.penalties import bad_word_ids

    p = SamplingParams(bad_words=[(9, 1), [2], [9, 1]])
    assert p.bad_words == ((2,), (9, 1)) and p.processes_logits and hash(p) == hash(SamplingParams(bad_words=[[2], [9, 1]]))
    assert SamplingParams(bad_words=[]).bad_words is None and not SamplingParams(bad_words=[]).processes_logits
    with pytest.raises(InvalidRequestError, match=r"bad_words holds token 49152, outside the vocabulary \[0, 49152\)"):
        smollm2_pipeline.engine.generate([[1, 2]], SamplingParams(bad_words=[[1, 49152]]))
    tok = smollm2_pipeline.tokenizer

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    assert bad_word_ids(["Red", " blue sky"], encode) == tuple(sorted({tuple(encode("Red")), tuple(encode(" Red")),
                                                                        tuple(encode(" blue sky"))}))
    assert bad_word_ids(["\n"], encode) == (tuple(encode("\n")),)  # whitespace as written only (no space variant)
    for words, message in (([""], "bad_words[0] must be a non-empty string, got ''"),
                           (["ok", 3], "bad_words[1] must be a non-empty string, got 3"),
                           ("Paris", "bad_words must be a list of strings, got str"),  # not its letters
                           (None, "bad_words must be a list of strings, got NoneType"),
                           (["x\ud800"], "bad_words[0] is not valid Unicode (a lone surrogate)"),
                           (["w"] * 1001, "bad_words holds 1001 words; give at most 1000")):
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            bad_word_ids(words, encode)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_bad_words_that_leave_nothing_to_choose_are_a_request_error(smollm2_pipeline, mode, temperature):
    """A grammar allowing "a" or "b" with both banned: nothing is left at the first position. Greedy emitted token 0
    (neither allowed nor grammatical), sampling failed in torch with a 500; now a request error naming bad_words."""
    from dflash_trt.runtime.guided import GuidedDecoding
    from dflash_trt.runtime.penalties import bad_word_ids

    pipe = smollm2_pipeline
    bad = bad_word_ids(["a", "b"], lambda w: pipe.tokenizer.encode(w, add_special_tokens=False))
    params = SamplingParams(max_tokens=4, temperature=temperature, seed=1, guided=GuidedDecoding(regex="[ab]"),
                            bad_words=bad)
    with pytest.raises(InvalidRequestError, match=r"bad_words ban every token this request may choose after 0 output "
                                                  r"tokens \(with its grammar, min_tokens or logit bias\)"):
        pipe.generate([pipe.encode("Pick a letter:")], params, mode=mode)
    ok = pipe.generate([pipe.encode("Pick a letter:")], dataclasses.replace(params, bad_words=bad[:1]), mode=mode)[0]
    assert pipe.decode(ok.token_ids[:1]) in ("a", "b")


def test_logit_bias_is_normalized_and_checked_against_the_vocabulary(smollm2_pipeline):
    p = SamplingParams(logit_bias={9: 1, 2: -3.5})
    assert p.logit_bias == ((2, -3.5), (9, 1.0)) and hash(p) == hash(SamplingParams(logit_bias=[(2, -3.5), (9, 1)]))
    assert SamplingParams(logit_bias={}).logit_bias is None and not SamplingParams(logit_bias={}).processes_logits
    with pytest.raises(InvalidRequestError, match=r"logit_bias names token 49152, outside the vocabulary \[0, 49152\)"):
        smollm2_pipeline.engine.generate([[1, 2]], SamplingParams(logit_bias={49152: 1.0}))


# ------------------------------------------------------------------------- greedy: Hugging Face's tokens

def test_a_bad_word_may_begin_in_the_prompt_in_tensorrt_llms_scope(smollm2_pipeline):
    """bad_words_read_prompt (TensorRT-LLM's banBadWords reads the whole sequence): a word made of the prompt's last
    token and the plain answer's first bans that first token, in DFlash as in AR; without it (vLLM's scope, the
    output only) the word never matches and the answer is the plain one."""
    pipe = smollm2_pipeline
    prompt = pipe.encode_chat(SHORT_CHAT)
    [plain] = pipe.generate([prompt], SamplingParams(max_tokens=6), mode="ar")
    word = [[prompt[-1], plain.token_ids[0]]]
    [output_only] = pipe.generate([prompt], SamplingParams(max_tokens=6, bad_words=word), mode="dflash")
    assert output_only.token_ids == plain.token_ids
    [ar] = pipe.generate([prompt], SamplingParams(max_tokens=6, bad_words=word, bad_words_read_prompt=True), mode="ar")
    [df] = pipe.generate([prompt], SamplingParams(max_tokens=6, bad_words=word, bad_words_read_prompt=True))
    assert df.token_ids == ar.token_ids and ar.token_ids[0] != plain.token_ids[0]


@pytest.fixture(scope="module")
def hf_target(smollm2_path):
    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


GREEDY_CASES = {
    "repetition": SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.3),
    "presence-frequency": SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=1.5, frequency_penalty=0.7),
    "prompt-scope": SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=1.5, frequency_penalty=0.7,
                                   prompt_ignore_length=4),  # TensorRT-LLM's: the chat prompt's tokens count too
    "bias": SamplingParams(max_tokens=MAX_TOKENS, logit_bias={504: 5.0, 30: -100.0}),
    "min_tokens": SamplingParams(max_tokens=MAX_TOKENS, min_tokens=20),
    # " Red" (colours' first answer), and "_" then "str" (the reversing function's input_str)
    "bad_words": SamplingParams(max_tokens=MAX_TOKENS, bad_words=[[3950], [79, 1321]]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_dflash_chains_trees_and_ar_give_hf_generate_tokens(smollm2_pipeline, hf_target, case):
    pipe = smollm2_pipeline
    params = GREEDY_CASES[case]
    eos = list(pipe.engine.eos_token_ids)
    chats = [SHORT_CHAT] if case == "min_tokens" else CHATS
    prompts = [pipe.encode_chat(c) for c in chats]
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        ref = hf_target.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                                 logits_processor=hf_processors(params, len(p), eos))[0, len(p):].tolist()
        plain = hf_target.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos,
                                   pad_token_id=eos[0])[0, len(p):].tolist()
        assert ref != plain  # the processing changes the answer
        refs.append(ref)
    if case == "min_tokens":
        assert len(plain) < 20 <= len(refs[0])  # the plain answer stops before min_tokens, this one cannot
    tree = Engine(pipe.engine.target, DFlashProposer(pipe.engine.proposer.drafter, pipe.engine.target, tree_topk=4),
                  pipe.engine.eos_token_ids)
    accepted = 0
    for engine, mode in [(pipe.engine, "dflash"), (tree, "dflash"), (pipe.engine, "ar")]:
        results = engine.generate(prompts, params, mode)  # a batch: rows of different lengths
        assert [r.token_ids for r in results] == refs, (mode, engine is tree)
        accepted += sum(r.metrics.accepted_tokens for r in results if mode == "dflash")
    assert accepted > 0  # drafts were verified under the processing


#: strong enough that the answer's later tokens depend on the drafts before them in the block
ORACLE_PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0)


@pytest.fixture(scope="module")
def oracle_case(smollm2_pipeline):
    """(engine with an oracle drafting the penalized greedy answer in blocks of 8, prompt, that answer)."""
    pipe = smollm2_pipeline
    prompt = pipe.encode_chat(CHATS[1])
    ref = pipe.engine.generate([prompt], ORACLE_PARAMS, "ar")[0].token_ids
    return Engine(pipe.engine.target, OracleProposer([prompt + ref], 8)), prompt, ref


def test_an_oracle_drafting_the_processed_answer_is_accepted_whole(oracle_case):
    """Drafts equal to the penalized answer are all accepted: position i's penalties count the i drafts
    before it."""
    engine, prompt, ref = oracle_case
    res = engine.generate([prompt], ORACLE_PARAMS, "dflash")[0]
    assert res.token_ids == ref and res.metrics.accepted_tokens == MAX_TOKENS - res.metrics.verify_steps


def test_forgetting_the_drafts_history_is_caught(oracle_case, monkeypatch):
    """The same run with every position given the history of the block's first one diverges."""
    engine, prompt, ref = oracle_case
    monkeypatch.setattr(engine_mod, "tree_prefixes", lambda tokens, parents, nodes: [[] for _ in range(nodes)])
    res = engine.generate([prompt], ORACLE_PARAMS, "dflash")[0]
    assert res.token_ids != ref and res.metrics.accepted_tokens < MAX_TOKENS - res.metrics.verify_steps


# --------------------------------------------------------------------------- sampling: the distribution

N = 3000
SAMPLED = SamplingParams(temperature=1.0, repetition_penalty=2.0, presence_penalty=0.8, frequency_penalty=0.6,
                         logit_bias={2: 1.5}, min_tokens=3, min_p=0.05, max_tokens=3, stop_token_ids=(5,))


def sampled_pvalue(engine, params):
    results = engine.generate([PROMPT] * N, [dataclasses.replace(params, seed=i) for i in range(N)],
                              "dflash")
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=3), 0)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    with torch.no_grad():  # each prefix's logits through HF's processors
        joint = exact_joint(engine.target, params, hf_processors(params, len(PROMPT), params.stop_token_ids))
    obs, exp, pooled_o, pooled_e, impossible = [], [], 0, 0.0, 0
    for k, pk in joint.items():
        if pk == 0:
            impossible += counts[k]  # probability 0 (min_tokens, min-p) but sampled
        elif pk * N >= 5:
            obs.append(counts[k])
            exp.append(pk * N)
        else:
            pooled_o += counts[k]
            pooled_e += pk * N
    if pooled_e > 0:  # (none left to pool when every rare sequence has probability 0)
        obs.append(pooled_o)
        exp.append(pooled_e)
    assert len(obs) >= 10
    p, rate = scaled_pvalue_and_rate(obs, exp, results)
    return p, impossible, rate


@pytest.mark.parametrize("sample_drafts", [True, False], ids=["sampled-drafts", "argmax-drafts"])
def test_dflash_sampling_keeps_the_processed_distribution(tiny, sample_drafts):
    target, drafter = tiny
    engine = Engine(target, DFlashProposer(drafter, target, sample_drafts=sample_drafts))
    p, impossible, rate = sampled_pvalue(engine, SAMPLED)
    assert 0.01 < rate < 0.95  # both verifier paths run (the penalties move p away from the drafter's q)
    assert impossible == 0 and p > 0.001


def test_dflash_sampling_keeps_the_distribution_with_bad_words(tiny):
    """Bad words (token 4 never; token 3 never right after 1) with the other processing: the sampled sequences
    keep the processed distribution, and none holds a bad word (each has probability 0: counted as impossible)."""
    target, drafter = tiny
    engine = Engine(target, DFlashProposer(drafter, target))
    p, impossible, rate = sampled_pvalue(engine, dataclasses.replace(SAMPLED, bad_words=[[4], [1, 3]]))
    assert impossible == 0 and p > 0.001 and rate > 0.01


def test_sampling_that_forgets_the_drafts_history_fails_the_same_test(tiny, monkeypatch):
    target, drafter = tiny
    monkeypatch.setattr(engine_mod, "chain_prefixes", lambda drafts, first, end: [[] for _ in range(first, end)])
    p, impossible, _ = sampled_pvalue(Engine(target, DFlashProposer(drafter, target)), SAMPLED)
    assert impossible > 0 or p < 1e-6


def test_drafts_follow_a_logit_bias(smollm2_pipeline, monkeypatch):
    """A +100 bias makes the target repeat one token; drafts that follow the bias are accepted whole (two
    verify steps of 16 for 32 tokens), drafts that ignore it are not."""
    pipe = smollm2_pipeline
    params = SamplingParams(max_tokens=32, ignore_eos=True, logit_bias={504: 100.0})
    prompt = pipe.encode_chat(CHATS[1])
    res = pipe.engine.generate([prompt], params, "dflash")[0]
    assert res.token_ids == [504] * 32 and res.metrics.verify_steps == 2
    monkeypatch.setattr(DFlashProposer, "_processed", lambda self, logits, processing: logits)
    res = pipe.engine.generate([prompt], params, "dflash")[0]
    assert res.token_ids == [504] * 32 and res.metrics.verify_steps > 4


def test_min_tokens_with_every_token_a_stop_token_is_refused(tiny):
    """Nothing would be left to choose (greedy took token 0 from an all -inf row; sampling failed in multinomial)."""
    engine = Engine(tiny[0])
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=list(range(VOCAB)))
    with pytest.raises(InvalidRequestError, match=r"min_tokens 2 holds back the stop tokens, and every token of the "
                                                  r"vocabulary \[0, 6\) is one"):
        engine.generate([PROMPT], params, "ar")
    assert engine.generate([PROMPT], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=list(range(VOCAB - 1))),
                           "ar")[0].token_ids[:2] == [VOCAB - 1] * 2


def test_logprobs_stay_the_raw_targets_with_logits_processing(smollm2_pipeline):
    """A +100 bias forces token 504 everywhere; the logprobs reported are the target's raw ones (the first
    token's too, which is chosen apart from the verify steps), equal in DFlash and ar."""
    pipe = smollm2_pipeline
    prompt = pipe.encode_chat(CHATS[1])
    params = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={504: 100.0}, logprobs=0)
    with torch.inference_mode():
        target = pipe.engine.target
        ids = torch.tensor([prompt + [504] * 5])
        out = target(ids, torch.arange(ids.shape[1])[None], target.new_cache(1, ids.shape[1]), ids.shape[1])
        raw = torch.log_softmax(target.compute_logits(out.hidden[0, len(prompt) - 1:]).float(), -1)[:, 504].tolist()
    for mode in ("dflash", "ar"):
        res = pipe.engine.generate([prompt], params, mode)[0]
        assert res.token_ids == [504] * 6
        assert [lp.logprob for lp in res.logprobs] == pytest.approx(raw, abs=1e-3) and raw[0] < -1
