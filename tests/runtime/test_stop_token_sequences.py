"""SamplingParams.stop_token_sequences (TensorRT-LLM's stop words list): the output ends with the token that
completes one of them, that sequence's tokens kept, also where drafts are accepted several at once (DFlash), also
where the sequence begins in the prompt (TensorRT-LLM's stop criterion reads the whole sequence), and before
min_tokens (which holds back only the stop tokens)."""

from __future__ import annotations

import re

import pytest

from dflash_trt.errors import InvalidRequestError
from dflash_trt.runtime.sampling import SamplingParams

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def greedy(smollm2_pipeline):
    ids = smollm2_pipeline.encode(PROMPT)
    [ref] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=24), mode="ar")
    assert len(ref.token_ids) == 24
    return ids, ref.token_ids


@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_the_output_ends_with_the_sequence_it_completes(smollm2_pipeline, greedy, mode):
    ids, out = greedy
    seq = tuple(out[9:12])  # a sequence that first appears ending at token 12 (checked below)
    assert all(tuple(out[i : i + 3]) != seq for i in range(9))
    [r] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=24, stop_token_sequences=[seq, [7, 7, 7]]),
                                    mode=mode)
    assert r.token_ids == out[:12] and r.finish_reason == "stop" and r.stop_reason is None
    assert r.metrics.completion_tokens == 12
    if mode == "dflash":
        assert r.metrics.accepted_tokens > 0  # the stop came inside a block of accepted drafts or not: same tokens


def test_a_sequence_may_begin_in_the_prompt_and_min_tokens_does_not_hold_it(smollm2_pipeline, greedy):
    ids, out = greedy
    seq = (ids[-1], out[0])
    for mode in ("ar", "dflash"):
        [r] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=24, stop_token_sequences=[seq]), mode=mode)
        assert r.token_ids == out[:1] and r.finish_reason == "stop", mode
    [r] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=24, min_tokens=5, stop_token_sequences=[out[:2]]),
                                    mode="dflash")
    assert r.token_ids == out[:2] and r.finish_reason == "stop"


def test_bad_sequences_are_refused_by_name(smollm2_pipeline):
    for value, words in (("ab", "stop_token_sequences must be a list of token id sequences"),
                         ([[1, -2]], "stop_token_sequences must be a list of token id sequences (non-empty lists of "
                                     "integers >= 0), or None; [1, -2] is not one"),
                         ([[]], "[] is not one"), ([[i] for i in range(1001)], "holds 1001 sequences; give at most 1000")):
        with pytest.raises(InvalidRequestError, match=re.escape(words)):
            SamplingParams(stop_token_sequences=value)
    assert SamplingParams(stop_token_sequences=[[3, 4], (1,), [3, 4]]).stop_token_sequences == ((1,), (3, 4))
    with pytest.raises(InvalidRequestError, match=r"stop_token_sequences holds token 99999999, outside the vocabulary"):
        smollm2_pipeline.generate([[1, 2]], SamplingParams(max_tokens=2, stop_token_sequences=[[5, 99999999]]))
