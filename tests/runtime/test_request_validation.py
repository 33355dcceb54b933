"""Requests are checked before anything runs: SamplingParams fields of the wrong type (a float max_tokens,
a string temperature, a bool for a number) and prompts given as text are one InvalidRequestError naming
the field or prompt, the value and what is allowed; tau and the acceptance rate of a request without a
verify step (max_tokens 1) are the documented values, in the object and in `to_dict` (generate --json)."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import torch

from dflash_trt.errors import InvalidRequestError
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.stats import RequestMetrics


@pytest.mark.parametrize("field, value, allowed", [
    ("max_tokens", 2.5, "max_tokens must be an integer >= 1, got 2.5 (float)"),
    ("max_tokens", True, "max_tokens must be an integer >= 1, got True (bool)"),
    ("max_tokens", "64", "max_tokens must be an integer >= 1, got '64' (str)"),
    ("top_k", 2.5, "top_k must be an integer >= 0 (0 = off), got 2.5 (float)"),
    ("seed", 1.5, "seed must be an integer in [-2**63, 2**64) or None, got 1.5 (float)"),
    ("seed", False, "seed must be an integer in [-2**63, 2**64) or None, got False (bool)"),
    ("temperature", "0.7", "temperature must be a number >= 0 (0 = greedy), got '0.7' (str)"),
    ("temperature", None, "temperature must be a number >= 0 (0 = greedy), got None (NoneType)"),
    ("top_p", True, "top_p must be a number in (0, 1] (1 = off), got True (bool)"),
    ("ignore_eos", 1, "ignore_eos must be True or False, got 1"),
    ("stop_token_ids", 2, "stop_token_ids must be a list or tuple of token ids (integers >= 0), or None for the "
                          "target's EOS ids, got 2 (int)"),
    ("stop_token_ids", "2", "stop_token_ids must be a list or tuple of token ids (integers >= 0), or None for the "
                            "target's EOS ids, got '2' (str)"),
    ("stop_token_ids", [2, 2.0], "stop_token_ids must be a list or tuple of token ids (integers >= 0), or None for "
                                 "the target's EOS ids; 2.0 in [2, 2.0] is not one"),
    ("stop_token_ids", [-1], "; -1 in [-1] is not one"),
])
def test_a_field_of_the_wrong_type_is_named(field, value, allowed):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{"temperature": 1.0, field: value})
    assert allowed in str(info.value)


def test_ranges_are_still_checked():
    for kw, msg in [(dict(max_tokens=0), "max_tokens must be >= 1, got 0"), (dict(top_k=-1), "top_k must be >= 0"),
                    (dict(top_p=0), "top_p must be in (0, 1], got 0.0"),
                    (dict(temperature=math.inf), "temperature must be finite and >= 0, got inf"),
                    (dict(seed=2**64), "seed must be a 64-bit integer")]:
        with pytest.raises(InvalidRequestError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")
                           .replace("[", r"\[")):
            SamplingParams(**kw)


def test_values_are_normalized_and_the_object_stays_hashable():
    """A list of stop ids becomes a tuple (a frozen dataclass holding a list was unhashable); numpy scalars
    and ints where a float goes become Python numbers (what torch's generator and top-k take)."""
    p = SamplingParams(temperature=1, top_k=np.int64(5), top_p=np.float32(0.5), max_tokens=np.int32(7),
                       stop_token_ids=[2, np.int64(3)], seed=np.uint64(9))
    assert p == SamplingParams(temperature=1.0, top_k=5, top_p=0.5, max_tokens=7, stop_token_ids=(2, 3), seed=9)
    assert hash(p) == hash(SamplingParams(temperature=1.0, top_k=5, top_p=0.5, max_tokens=7, stop_token_ids=(2, 3),
                                          seed=9))
    assert [type(v) for v in (p.temperature, p.top_k, p.top_p, p.max_tokens, p.seed)] == [float, int, float, int, int]
    assert type(p.stop_token_ids[1]) is int and {p: 1}[p] == 1
    assert dataclasses.replace(p, stop_token_ids=[4]).stop_token_ids == (4,)
    assert SamplingParams(stop_token_ids=[]).stop_token_ids == () and SamplingParams().stop_token_ids is None


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A tiny random Llama target (vocab 96) with an untrained 1-layer block-4 drafter."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter, load_drafter, load_target, new_drafter_config
    from dflash_trt.runtime.engine import Engine
    from dflash_trt.runtime.proposer import DFlashProposer
    from tests.conftest import make_hf_model

    tmp = tmp_path_factory.mktemp("engine")
    _, folder = make_hf_model(tmp)
    target = load_target(folder)
    drafter = load_drafter(init_drafter(new_drafter_config(TargetConfig.from_pretrained(folder), 1, 4, 95, [1, 2]),
                                        tmp / "d"))
    return Engine(target, DFlashProposer(drafter, target))


HOW = ("prompts are lists of token ids (ints), one list per prompt; tokenize text first with Pipeline.encode(text) "
       "or Pipeline.encode_chat(message) (Pipeline.generate also takes text)")


@pytest.mark.parametrize("prompts, what", [
    (["Hello"], "; prompt 0 is str 'Hello'"),
    ("Hello", "; got str 'Hello'"),
    ([[5, 6], ["a", "b"]], "; prompt 1 holds str 'a'"),
    ([5, 6, 7], "; prompt 0 is int 5 (a single prompt? wrap its ids: [ids])"),
    ([[5, 6.0]], "; prompt 0 holds float 6.0"),
    ([[5, True]], "; prompt 0 holds bool True"),
    ([{5, 6}], "; prompt 0 is set {5, 6}"),
    (torch.tensor([5, 6]), "; got Tensor tensor([5, 6]) (a single prompt? wrap it: [ids])"),
    (np.array([[5, 6], [7, 8]]), "; got ndarray array([[5, 6],\n       [7, 8]]) (one prompt per row? give "
                                 "list(prompts))"),
])
def test_prompts_that_are_not_token_id_lists(engine, prompts, what):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(prompts, SamplingParams(max_tokens=2), "ar")
    assert str(info.value) == HOW + what


def test_prompts_as_tuples_numpy_and_tensors_decode_as_lists(engine):
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    want = engine.generate([[5, 6, 7]], params, "ar")[0].token_ids
    for prompt in ((5, 6, 7), np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int64(5), 6, 7]):
        assert engine.generate([prompt], params, "ar")[0].token_ids == want, type(prompt)
    assert [r.token_ids for r in engine.generate(list(torch.tensor([[5, 6, 7], [5, 6, 7]])), params, "ar")] == [want] * 2
    with pytest.raises(InvalidRequestError, match="params must be a SamplingParams or a list of them"):
        engine.generate([[5, 6]], {"max_tokens": 2}, "ar")


@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_a_request_without_verify_steps_reports_tau_1_and_no_acceptance_rate(engine, mode):
    """max_tokens 1: the only token comes from prefill, no verify step: tau is 1.0 (the autoregressive
    value, not the 0.00 it was), the acceptance rate undefined: 0.0 as a float, None in to_dict as in
    bench's results.json."""
    res = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=1, ignore_eos=True), mode)[0]
    m = res.metrics
    assert (m.completion_tokens, m.verify_steps, m.drafted_tokens) == (1, 0, 0)
    assert m.acceptance_length == 1.0 and m.acceptance_rate == 0.0
    d = m.to_dict()
    assert d["acceptance_length"] == 1.0 and d["acceptance_rate"] is None


def test_tau_and_acceptance_rate_of_decoded_requests(engine):
    ar = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True), "ar")[0].metrics
    assert ar.verify_steps == 5 and ar.acceptance_length == 1.0 and ar.to_dict()["acceptance_rate"] is None
    spec = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True), "dflash")[0].metrics
    assert spec.drafted_tokens > 0 and spec.to_dict()["acceptance_rate"] == spec.acceptance_rate
    assert spec.to_dict()["acceptance_length"] == spec.acceptance_length == 5 / spec.verify_steps
    m = RequestMetrics(completion_tokens=9, drafted_tokens=6, accepted_tokens=3, verify_steps=2)
    assert (m.acceptance_length, m.acceptance_rate) == (4.0, 0.5) and m.to_dict()["acceptance_rate"] == 0.5


def test_pipeline_encode_names_text_a_tokenizer_cannot_take(smollm2_path):
    """Pipeline.encode / encode_chat of a non-str (encode_chat: nor a list of messages) or of text holding a lone
    surrogate: InvalidRequestError naming the argument (the tokenizer's own error was a TypeError about
    'TextEncodeInput')."""
    from dflash_trt.api import Pipeline, load_tokenizer

    pipe = Pipeline(engine=None, tokenizer=load_tokenizer(smollm2_path), target_path=smollm2_path, drafter_path=None)
    assert pipe.encode("Hi") == pipe.tokenizer("Hi")["input_ids"]
    for method, name in ((pipe.encode, "text"), (pipe.encode_chat, "message")):
        with pytest.raises(InvalidRequestError) as exc:
            method("x\ud800")
        assert str(exc.value) == (f"{name} holds an unpaired surrogate (U+D800) at character 2, which is not a "
                                  "character; give valid Unicode text")
    with pytest.raises(InvalidRequestError, match="^text must be a str, got list$"):
        pipe.encode([1, 2])
    with pytest.raises(InvalidRequestError, match=r'^message: message 1 is 1, not an object; give each message as \{'):
        pipe.encode_chat([1, 2])  # a list is a conversation
    with pytest.raises(InvalidRequestError, match=r'^message must be a str \(one user message\) or a list of '
                                                  r'\{"role", "content"\} messages, got tuple$'):
        pipe.encode_chat(("Hi",))
    assert pipe.decode(pipe.encode("Hi there")) == "Hi there" and pipe.decode([]) == ""
    ids = pipe.encode("Hi there")
    for same in (tuple(ids), np.array(ids), torch.tensor(ids), [np.int64(t) for t in ids]):
        assert pipe.decode(same) == "Hi there"
    for odd, words in ((np.array([ids]), "got a 2-D ndarray of int64 with shape (1, 2)"),
                       (torch.tensor([ids]), "got a 2-D Tensor of torch.int64 with shape (1, 2)"),
                       (torch.tensor([1.0, 2.0]), "got a 1-D Tensor of torch.float32"),
                       ([ids], "got a list holding [" ), (["a", "b"], "got a list holding 'a' (str)"),
                       ([True, False], "got a list holding True (bool)"), (None, "got NoneType"), (5, "got int"),
                       ([1.0], "got a list holding 1.0 (float)")):
        with pytest.raises(InvalidRequestError, match="ids must be a flat sequence of integer token ids, "
                                                      + re.escape(words)):
            pipe.decode(odd)
    for ids, bad in (([5, 10**9], 10**9), ([-1], -1), ([len(pipe.tokenizer)], len(pipe.tokenizer))):
        with pytest.raises(InvalidRequestError, match=rf"token id {bad} is outside the vocabulary \[0, 49152\)"):
            pipe.decode(ids)


def test_an_empty_params_list_is_zero_params_not_the_default(engine):
    """generate(prompts, []) ran every prompt with the default SamplingParams (an empty list was taken as
    None); it is a list of 0 params, refused like any count that does not match the prompts."""
    with pytest.raises(InvalidRequestError) as exc:
        engine.generate([[5, 6]], [], mode="ar")
    assert str(exc.value) == "1 prompts but 0 sampling params"
    assert engine.generate([], [], mode="ar") == []


@pytest.mark.parametrize("kwargs, words", [
    (dict(target=123), "target must be a folder path (str or pathlib.Path) or None for the default, got int 123"),
    (dict(drafter=1.5), "drafter must be a folder path"),
    (dict(block_size="8"), "block_size must be an integer or None, got str '8'"),
    (dict(max_draft_len=True), "max_draft_len must be an integer or None, got bool True"),
])
def test_load_pipeline_names_a_wrong_argument_type(kwargs, words):
    from dflash_trt.api import load_pipeline
    from dflash_trt.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        load_pipeline(**kwargs)
    assert words in str(exc.value)


def test_bad_proposer_options_are_refused_when_the_engine_is_made(engine):
    """A block size of 0 had silently meant the drafter's; a tree_topk above the draft vocabulary had loaded, then
    failed in torch.topk at the first step."""
    from dflash_trt.errors import ConfigError
    from dflash_trt.runtime.proposer import DFlashProposer

    drafter, target = engine.proposer.drafter, engine.target
    with pytest.raises(ConfigError, match="block size must be >= 2, got 0"):
        DFlashProposer(drafter, target, block_size=0)
    assert DFlashProposer(drafter, target, tree_topk=96).tree_topk == 96  # the whole vocabulary: allowed
    with pytest.raises(ConfigError, match="tree_topk 97 is more than the drafter's 96 draft tokens; use at most 96"):
        DFlashProposer(drafter, target, tree_topk=97)


def test_an_on_tokens_that_is_not_callable_is_refused_before_any_work(engine):
    from dflash_trt.runtime.sampling import SamplingParams

    with pytest.raises(InvalidRequestError, match=r"stop_token_ids holds 96, outside the vocabulary \[0, 96\)"):
        engine.generate([[5, 6]], SamplingParams(max_tokens=2, stop_token_ids=[3, 96]))  # one that could never fire

    with pytest.raises(InvalidRequestError, match=r"on_tokens must be a function .* got 5 \(int\)"):
        engine.generate([[5, 6]], SamplingParams(max_tokens=2), on_tokens=5)
    with pytest.raises(InvalidRequestError, match=r"on_finished must be a function \(prompt_index, result\) or None, "
                                                  r"got 'x' \(str\)"):
        engine.generate([[5, 6]], SamplingParams(max_tokens=2), on_finished="x")


def test_ignore_eos_keeps_the_stop_token_ids_given(engine):
    """ignore_eos drops the target's EOS ids only (vLLM's meaning): stop_token_ids given explicitly still end the
    output (they had been dropped too)."""
    from dflash_trt.runtime.sampling import SamplingParams

    free = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=24, ignore_eos=True), "ar")[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    stop = free.token_ids[9]
    first = free.token_ids.index(stop)
    for mode in ("ar", "dflash"):
        out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop]),
                              mode)[0]
        assert (out.token_ids, out.finish_reason) == (free.token_ids[: first + 1], "stop"), mode


def test_seeds_that_differ_in_their_high_bits_sample_differently_on_the_cpu(engine):
    """torch's CPU generator keeps 32 bits of its seed: seeds 1, 2**32 + 1 and -2**63 + 1 had sampled the same
    tokens. A seed in [0, 2**32) samples as before (the generator seeded with it)."""
    import torch

    from dflash_trt.runtime.sampling import SamplingParams, generator_seed

    cpu = torch.device("cpu")
    assert generator_seed(1, cpu) == 1 and generator_seed(2**32 - 1, cpu) == 2**32 - 1
    assert len({generator_seed(s, cpu) for s in (1, 2**32 + 1, 2**40 + 1, -(2**63) + 1, 2**64 - 1)}) == 5
    assert generator_seed(-1, cpu) == generator_seed(2**64 - 1, cpu)  # one 64-bit value, as torch reads it
    assert all(0 <= generator_seed(s, cpu) < 2**32 for s in (2**32, 2**64 - 1, -(2**63)))
    assert generator_seed(2**40 + 1, torch.device("cuda")) == 2**40 + 1  # Philox keeps 64 bits

    def sample(seed):
        p = SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True)
        return engine.generate([[5, 6, 7]], p, "ar")[0].token_ids

    outs = [sample(s) for s in (1, 2**32 + 1, 2**40 + 1)]
    assert outs[0] != outs[1] and outs[0] != outs[2] and outs[1] != outs[2]
    assert sample(2**32 + 1) == outs[1]  # still reproducible


def test_a_prompt_id_outside_the_vocabulary_names_the_prompt_and_the_id(engine):
    """It was "prompt token ids must be in [0, 96)": which prompt, which id, and what to do were left out."""
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError) as info:
        engine.generate([[5, 6], [7, 96, 8]], params, "ar")
    assert str(info.value) == ("prompt 1 holds token id 96 (at position 1), outside the target's vocabulary [0, 96); "
                               "give token ids of the target's tokenizer (Pipeline.encode / encode_chat make them)")
    with pytest.raises(InvalidRequestError, match=r"^prompt 0 holds token id -1 \(at position 0\)"):
        engine.generate([[-1, 5]], params, "ar")
    with pytest.raises(InvalidRequestError, match=r"^empty prompt \(prompt 1\): give at least one token"):
        engine.generate([[5], []], params, "ar")


def test_an_on_tokens_returning_neither_none_nor_a_str_is_refused(engine):
    """A callback returning True (meaning "stop") ended the request with finish_reason True, 5 with 5: now the
    call raises, naming the value and what to return; the engine then gives what it gave before."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    want = engine.generate([[5, 6, 7]], params)[0].token_ids
    for value in (True, 5, ["stop"]):
        with pytest.raises(InvalidRequestError, match=rf"^on_tokens returned {re.escape(repr(value))} "
                           rf"\({type(value).__name__}\): return None to go on, or a finish reason string"):
            engine.generate([[5, 6, 7]], params, on_tokens=lambda *a, value=value: value)
        assert engine.generate([[5, 6, 7]], params)[0].token_ids == want
    res = engine.generate([[5, 6, 7]], params, on_tokens=lambda *a: "stop")[0]
    assert res.finish_reason == "stop" and res.token_ids == want[:1]
    assert engine.generate([[5, 6, 7]], params, on_tokens=lambda *a: "")[0].token_ids == want


def test_calls_from_two_threads_run_one_at_a_time(engine):
    """Two threads calling generate on one engine shared the drafter's context cache: the second call, made
    while the first waited in its on_tokens, replaced it, and the first then failed ("kv_inject: position 40
    outside the cache's capacity 40") or drafted from the other's context. Now the second waits for the first;
    both return what they return alone."""
    import threading

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    want = [engine.generate([p], params)[0].token_ids for p in prompts]
    got, waited, emits = {}, [], []

    def second():
        got[1] = engine.generate([prompts[1]], params)[0].token_ids

    other = threading.Thread(target=second)

    def first_tokens(*args):
        emits.append(args[1])
        if len(emits) == 2:  # a verify step's tokens (the first are the prefill's): start the other call
            other.start()
            other.join(timeout=0.5)
            waited.append(other.is_alive())

    got[0] = engine.generate([prompts[0]], params, on_tokens=first_tokens)[0].token_ids
    other.join()
    assert waited == [True]  # the second call was still waiting when the first went on
    assert got == {0: want[0], 1: want[1]}


def test_generate_from_its_own_on_tokens_is_refused(engine):
    """Such a call replaced the running call's drafter context cache, which then failed in its next injection
    ("kv_inject: position 40 outside the cache's capacity 40" on SmolLM2); with the lock that serializes calls it
    would wait forever: it raises instead, and the engine works after."""
    from dflash_trt.errors import DFlashError

    params = SamplingParams(max_tokens=3, ignore_eos=True)
    want = engine.generate([[5, 6, 7]], params)[0].token_ids
    again = "^generate was called from its own callback \\(on_tokens or on_finished\\)"
    with pytest.raises(DFlashError, match=again):
        engine.generate([[5, 6, 7]], params, on_tokens=lambda *a: engine.generate([[8, 9, 10]], params) and None)
    with pytest.raises(DFlashError, match=again):
        engine.generate([[5, 6, 7]], params, on_finished=lambda *a: engine.generate([[8, 9, 10]], params))
    assert engine.generate([[5, 6, 7]], params)[0].token_ids == want
