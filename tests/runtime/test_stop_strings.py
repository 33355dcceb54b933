"""Stop strings in the Python API (`SamplingParams.stop`): the output ends with the token that completes the first
one, the text before it; and SamplingParams' named errors for other libraries' keywords."""

from __future__ import annotations

import pytest

from dflash_trt.errors import ConfigError, InvalidRequestError
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.sampling import SamplingParams
from tests.runtime.oracle import OracleProposer
from tests.runtime.test_stops import check_counters

CHAT = "Write a short poem about the sea."


@pytest.fixture(scope="module")
def poem(smollm2_pipeline):
    """(pipeline, prompt, the greedy output's 48 token ids and their text), EOS ignored."""
    pipe = smollm2_pipeline
    prompt = pipe.encode_chat(CHAT)
    [ref] = pipe.generate([prompt], SamplingParams(max_tokens=48, ignore_eos=True), "ar")
    return pipe, prompt, ref.token_ids, ref.text


def completes(pipe, ids: list[int], stop: str, after: int = 0) -> int:
    """The number of tokens of `ids` whose text first holds `stop` ending past the first `after` tokens' text."""
    floor = len(pipe.decode(ids[:after]))
    return next(k for k in range(after + 1, len(ids) + 1) if pipe.decode(ids[:k]).find(stop, max(0, floor - len(stop) + 1)) >= 0)


@pytest.mark.parametrize("proposer", ["ar", "drafter", "oracle"])
def test_a_stop_string_ends_the_output_at_the_token_completing_it(poem, proposer):
    """Greedy, in every mode: the ids are the reference's up to the token that completes the string (the oracle's
    blocks are all accepted, so the string ends inside a block and the tokens after it are dropped), the text ends
    before the string, on_tokens and logprobs see exactly those tokens, finish_reason "stop"."""
    pipe, prompt, ref, text = poem
    stop = text[30:36]  # inside the poem's first line, not at its start
    k = completes(pipe, ref, stop)
    engine = pipe.engine
    if proposer == "oracle":
        engine = Engine(pipe.engine.target, OracleProposer([prompt + ref], 16))
        engine.detokenize = pipe.engine.detokenize
    seen: list[int] = []
    [res] = engine.generate([prompt], SamplingParams(max_tokens=48, stop=stop, logprobs=0),
                            "ar" if proposer == "ar" else "dflash", lambda i, toks, lps: seen.extend(toks))
    assert res.token_ids == ref[:k] == seen and 0 < k < len(ref)
    assert res.text == text[: text.index(stop)] and res.finish_reason == "stop" and res.stop_reason == stop
    assert len(res.logprobs) == k and [lp.token_id for lp in res.logprobs] == ref[:k]
    if proposer != "ar":
        check_counters(res, 16)
    if proposer == "oracle":  # the whole answer was one accepted block, cut after the stop string
        assert res.metrics.verify_steps == 1


def test_stop_strings_of_one_request_leave_the_others_of_the_batch_alone(poem):
    """Two prompts in one call, only the first with stop strings (the earliest of two wins): the second gets what
    it gets alone (text decoded by the pipeline), the first ends at its string."""
    pipe, prompt, ref, text = poem
    other = pipe.encode_chat("Name three colors.")
    [alone] = pipe.generate([other], SamplingParams(max_tokens=24))
    late, early = text[40:45], text[20:25]
    a, b = pipe.generate([prompt, other], [SamplingParams(max_tokens=48, stop=[late, early]),
                                          SamplingParams(max_tokens=24)])
    assert a.token_ids == ref[: completes(pipe, ref, early)] and a.text == text[: text.index(early)]
    assert (b.token_ids, b.text, b.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)


def test_a_stop_string_within_min_tokens_is_text(poem):
    """With min_tokens = the tokens up to a string's first occurrence, that one is text and the output ends at
    the next (the server's rule, `StopText`)."""
    pipe, prompt, ref, text = poem
    stop = next(text[i : i + 6] for i in range(len(text)) if text.count(text[i : i + 6]) >= 2 and text[i].isalpha())
    first = completes(pipe, ref, stop)
    second = completes(pipe, ref, stop, after=first)
    [res] = pipe.generate([prompt], SamplingParams(max_tokens=48, stop=stop, min_tokens=first))
    assert res.token_ids == ref[:second] and res.finish_reason == "stop"
    assert res.text == text[: text.index(stop, text.index(stop) + 1)]


def test_stop_reason_names_a_stop_token_asked_for_and_not_the_eos(poem):
    """vLLM's and TensorRT-LLM's stop_reason: the token of stop_token_ids that ended the output; None at the
    target's EOS ids (the default stop tokens) and at max_tokens."""
    pipe, prompt, ref, _ = poem
    [res] = pipe.generate([prompt], SamplingParams(max_tokens=48, stop_token_ids=[ref[5]]))
    assert res.token_ids == ref[: ref.index(ref[5]) + 1] and res.stop_reason == ref[5]
    [eos] = pipe.generate([pipe.encode_chat("What is the capital of France? Answer in one sentence.")],
                          SamplingParams(max_tokens=40))
    assert eos.finish_reason == "stop" and eos.token_ids[-1] in pipe.engine.eos_token_ids and eos.stop_reason is None
    [cut] = pipe.generate([prompt], SamplingParams(max_tokens=4))
    assert cut.finish_reason == "length" and cut.stop_reason is None
    # the EOS among stop_token_ids given explicitly is still an EOS (vLLM's and serve's None), unless ignore_eos:
    # then it is a stop token like any other
    own = [eos.token_ids[-1], ref[40]]
    for ignore_eos, reason in ((False, None), (True, eos.token_ids[-1])):
        [again] = pipe.generate([pipe.encode_chat("What is the capital of France? Answer in one sentence.")],
                                SamplingParams(max_tokens=40, stop_token_ids=own, ignore_eos=ignore_eos))
        assert again.token_ids == eos.token_ids and again.finish_reason == "stop" and again.stop_reason == reason


def test_an_engine_without_a_tokenizer_refuses_stop_strings(poem):
    pipe, prompt, _, _ = poem
    engine = Engine(pipe.engine.target, None)
    with pytest.raises(ConfigError, match="stop strings need the target's tokenizer.*load_pipeline"):
        engine.generate([prompt], SamplingParams(max_tokens=4, stop="x"), "ar")
    [res] = engine.generate([prompt], SamplingParams(max_tokens=4), "ar")  # the engine's own text: none
    assert res.text is None and len(res.token_ids) == 4


@pytest.mark.parametrize("kwargs, message", [
    ({"stop": ""}, "stop holds an empty string, which would stop before any text; remove it"),
    ({"stop": ["a", 3]}, "stop must be a string or a list of strings (non-empty), or None; 3 (int) is not a string"),
    ({"stop": b"x"}, "stop must be a string or a list of strings"),
    ({"stop": "\ud800"}, "stop holds an unpaired surrogate (U+D800)"),
    ({"n": 2}, "SamplingParams has no field 'n': one completion per prompt here: repeat the prompt"),
    ({"best_of": 2}, "SamplingParams has no field 'best_of'"),
    ({"max_new_tokens": 8}, "SamplingParams has no field 'max_new_tokens': use max_tokens"),
    ({"end_id": 2}, "SamplingParams has no field 'end_id': use stop_token_ids=[id]"),
    ({"temprature": 1.0}, "SamplingParams has no field 'temprature': did you mean temperature?"),
    # other libraries' keywords whose closest field name would mislead (stop_token_ids, presence_penalty, ...)
    ({"stop_strings": ["x"]}, "SamplingParams has no field 'stop_strings': use stop (a string or a list"),
    ({"pad_token_id": 0}, "SamplingParams has no field 'pad_token_id': no padding here"),
    ({"length_penalty": 1.0}, "SamplingParams has no field 'length_penalty': a beam search option"),
    ({"allowed_token_ids": [1]}, "SamplingParams has no field 'allowed_token_ids': not supported: guided"),
    ({"return_log_probs": True}, "SamplingParams has no field 'return_log_probs': use logprobs=0"),
    ({"guided_decoding": None}, "SamplingParams has no field 'guided_decoding': use guided=GuidedDecoding"),
    ({"num_beams": 4}, "SamplingParams has no field 'num_beams': beam search is not supported"),
])
def test_bad_stop_strings_and_other_libraries_keywords_are_named(kwargs, message):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


def test_stop_strings_are_stored_as_a_tuple_without_repeats():
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=["b", "a", "b"]).stop == ("b", "a")
    assert SamplingParams(stop=[]).stop is None
    assert SamplingParams(stop=("x",)) == SamplingParams(stop=["x"])  # hashable, comparable


@pytest.mark.parametrize("stops, text", [
    (("abcdef", "cd"), "xxabcdefyy"),  # the longer one starts first, the shorter completes first
    (("cde", "cd"), "abcdefg"),  # both start at the same character: the shorter completed first
    (("ef", "abc"), "abcdefg"),
    (("zz",), "abcdefg"),  # none
])
@pytest.mark.parametrize("min_tokens", [0, 2])
def test_stop_text_does_not_depend_on_how_the_tokens_come(stops, text, min_tokens):
    """`StopText` fed a text's tokens (one character each) all at once, one at a time and in blocks of 3 ends at the
    same token with the same text and matched stop string (accepted drafts come several at once)."""
    from dflash_trt.runtime.stop_text import StopText

    def decode(ids):
        return "".join(map(chr, ids))

    ids = [ord(c) for c in text]
    outcomes = set()
    for size in (len(ids), 1, 3):
        st = StopText(decode, stops, min_tokens=min_tokens)
        for i in range(0, len(ids), size):
            if st.add(ids[i : i + size]) == "stop":
                break
        outcomes.add((st.text, st.generated, st.stopped, st.matched))
    assert len(outcomes) == 1
    [(got, generated, stopped, matched)] = outcomes
    first = min(((text.find(s) + len(s), len(s), s) for s in stops if s in text), default=None)
    if first is None:
        assert (got, generated, stopped, matched) == (text, len(text), False, None)
    else:
        end, _, s = first
        assert (got, generated, stopped, matched) == (text[: end - len(s)], end, True, s)


def test_other_libraries_keywords_at_their_neutral_values_are_accepted():
    """n=1, best_of=None, use_beam_search=False, include_stop_str_in_output=False (what vLLM code often passes) ask
    for what SamplingParams does anyway: dropped; any other value, a bool for a count included, is named."""
    assert SamplingParams(max_tokens=8, n=1, best_of=None, use_beam_search=False, include_stop_str_in_output=False,
                          num_beams=1) == SamplingParams(max_tokens=8)
    for kwargs in ({"n": True}, {"n": 2}, {"use_beam_search": True}, {"include_stop_str_in_output": True},
                   {"best_of": 1.0}):
        with pytest.raises(InvalidRequestError, match=f"SamplingParams has no field '{next(iter(kwargs))}'"):
            SamplingParams(**kwargs)
