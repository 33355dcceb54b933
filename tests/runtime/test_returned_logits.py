"""SamplingParams.return_context_logits / return_generation_logits (TensorRT-LLM's names): the target's raw float32
logits at every prompt position and at the position each output token was chosen from, equal to one reference
forward of the target (transformers) over the prompt and the output, the same in DFlash and autoregressive decoding,
with chunked prefill, and cut with the output at a stop string."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.runtime.decode_batch import DecodeBatch
from dflash_trt.runtime.sampling import SamplingParams

QUESTION = "What is the capital of France? Answer in one sentence."
LOGITS = dict(return_context_logits=True, return_generation_logits=True)


@pytest.fixture(scope="module")
def hf_target(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def reference(hf_target, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The target's logits [len(prompt) + len(out), V] over the prompt and the output, in one forward."""
    with torch.no_grad():
        return hf_target(torch.tensor([prompt + out])).logits[0]


def test_logits_are_one_reference_forwards_in_dflash_and_ar(smollm2_pipeline, hf_target):
    pipe = smollm2_pipeline
    prompt = pipe.encode_chat(QUESTION)
    [ar] = pipe.generate([prompt], SamplingParams(max_tokens=24, **LOGITS), mode="ar")
    [df] = pipe.generate([prompt], SamplingParams(max_tokens=24, **LOGITS), mode="dflash")
    assert df.token_ids == ar.token_ids and df.metrics.accepted_tokens > 0  # drafts were accepted several at once
    ref = reference(hf_target, prompt, ar.token_ids)
    n, vocab = len(prompt), pipe.engine.target.config.vocab_size
    for r in (ar, df):
        assert r.context_logits.dtype == r.generation_logits.dtype == torch.float32
        assert tuple(r.context_logits.shape) == (n, vocab)
        assert tuple(r.generation_logits.shape) == (len(r.token_ids), vocab)
        torch.testing.assert_close(r.context_logits, ref[:n], atol=2e-3, rtol=0)
        torch.testing.assert_close(r.generation_logits, ref[n - 1 : -1], atol=2e-3, rtol=0)
        # each output token is the argmax of the logits it was chosen from (greedy)
        assert r.generation_logits.argmax(-1).tolist() == r.token_ids
    torch.testing.assert_close(df.generation_logits, ar.generation_logits, atol=1e-3, rtol=0)
    [plain] = pipe.generate([prompt], SamplingParams(max_tokens=4), mode="dflash")
    assert plain.context_logits is None and plain.generation_logits is None  # only where asked for


def test_chunked_prefill_and_a_stop_string_keep_the_logits_in_step(smollm2_pipeline, hf_target):
    """Chunked prefill (7 prompt tokens a step) gives the whole prompt's logits in order; a request of the same batch
    stopped by a stop string has one logits row per output token it kept."""
    pipe = smollm2_pipeline
    prompt = pipe.encode_chat(QUESTION)
    [whole] = pipe.generate([prompt], SamplingParams(max_tokens=16), mode="ar")
    batch = DecodeBatch(pipe.engine, "dflash", prefill_chunk=7)
    batch.add([prompt, prompt], [SamplingParams(max_tokens=16, **LOGITS),
                                 SamplingParams(max_tokens=16, stop=["France"], return_generation_logits=True)])
    done = {}
    while batch.active:
        batch.step()
        done.update(batch.take_finished())
    done.update(batch.take_finished())
    ref = reference(hf_target, prompt, whole.token_ids)
    n = len(prompt)
    torch.testing.assert_close(done[0].context_logits, ref[:n], atol=2e-3, rtol=0)
    torch.testing.assert_close(done[0].generation_logits, ref[n - 1 : -1], atol=2e-3, rtol=0)
    cut = done[1]
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(whole.token_ids)
    assert cut.context_logits is None and cut.generation_logits.shape[0] == len(cut.token_ids)
    torch.testing.assert_close(cut.generation_logits, ref[n - 1 : n - 1 + len(cut.token_ids)], atol=2e-3, rtol=0)


def test_the_flags_must_be_bools():
    from dflash_trt.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="return_context_logits must be True or False, got 1"):
        SamplingParams(return_context_logits=1)
    with pytest.raises(InvalidRequestError, match="return_generation_logits must be True or False, got 'yes'"):
        SamplingParams(return_generation_logits="yes")
