"""Our target forward vs HF transformers: logits, greedy tokens, feature taps, RoPE scaling."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.models.checkpoints import load_target
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.sampling import SamplingParams
from tests.conftest import make_hf_model


def our_forward(model, ids, feature_ids=()):
    cache = model.new_cache(1, ids.shape[1] + 1)
    pos = torch.arange(ids.shape[1])[None]
    return model(ids, pos, cache, ids.shape[1], feature_layer_ids=feature_ids)


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def hf_greedy(hf, ids, n):
    out = hf.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_tiny_random_matches_hf(tmp_path, model_type):
    hf, folder = make_hf_model(tmp_path, model_type)
    ours = load_target(folder)
    ids = torch.randint(3, 96, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = our_forward(ours, ids, tuple(range(4)))
    assert rel_err(out.logits, ref.logits) < 1e-4
    # feature id l == HF hidden_states[l + 1]; the last id is HF's last entry (after the final norm)
    for i in range(4):
        torch.testing.assert_close(out.features[..., i * 64:(i + 1) * 64], ref.hidden_states[i + 1], rtol=1e-4, atol=1e-5)
    ours_tokens = Engine(ours).generate([ids[0].tolist()], SamplingParams(max_tokens=64, ignore_eos=True), "ar")[0]
    assert ours_tokens.token_ids == hf_greedy(hf, ids, 64)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_prefill_from_position_0_uses_the_causal_kernel_with_the_same_values(tmp_path, model_type, monkeypatch):
    """A prefill from position 0 (kv_len == t) attends with SDPA's is_causal (`CAUSAL`); any other forward (a
    later chunk, a verify block) with the bool mask by position; both give the values of the bool mask."""
    import dflash_trt.models.target as target_module

    _, folder = make_hf_model(tmp_path, model_type)
    model = load_target(folder)
    ids = torch.randint(3, 96, (2, 23), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(23).expand(2, 23)
    masks = []
    real = target_module.attention
    monkeypatch.setattr(target_module, "attention", lambda q, k, v, m, s: masks.append(m) or real(q, k, v, m, s))
    with torch.no_grad():
        fast = model(ids, pos, model.new_cache(2, 24), 23, feature_layer_ids=(1, 3))
        assert masks and all(m is target_module.CAUSAL for m in masks)
        bool_mask = torch.arange(23)[None, None, None, :] <= pos[:, None, :, None]
        slow = model(ids, pos, model.new_cache(2, 24), 23, feature_layer_ids=(1, 3), attn_mask=bool_mask)
        masks.clear()
        cache = model.new_cache(2, 24)  # the same prompts in two chunks: the second has kv_len 23 > t 13
        model(ids[:, :10], pos[:, :10], cache, 10)
        chunked = model(ids[:, 10:], pos[:, 10:], cache, 23, feature_layer_ids=(1, 3))
    assert isinstance(masks[-1], torch.Tensor) and masks[-1].shape == (2, 1, 13, 23)
    assert torch.equal(fast.logits, slow.logits) and torch.equal(fast.features, slow.features)
    torch.testing.assert_close(chunked.logits, fast.logits[:, 10:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
])
def test_rope_scaling_matches_hf(tmp_path, rope):
    rope = dict(rope, rope_theta=10000.0)
    hf, folder = make_hf_model(tmp_path, "llama", rope_parameters=rope)
    ours = load_target(folder)
    ids = torch.randint(3, 96, (1, 200), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(our_forward(ours, ids).logits, hf(ids).logits) < 1e-4


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    return hf, load_target(smollm2_path), tok


def test_smollm2_logits_and_features_match_hf(smollm2_pair):
    hf, ours, tok = smollm2_pair
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}],
                                                add_generation_prompt=True, tokenize=True)["input_ids"]])
    layers = tuple(range(30))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        out = our_forward(ours, ids, layers)
    assert rel_err(out.logits, ref.logits) < 1e-4
    # every id l matches HF hidden_states[l + 1]; for the last id (29) HF's entry is the output AFTER
    # the final norm, which is what z-lab's reference feeds the drafter, and what we return
    for l in layers:
        feat = out.features[..., l * 576:(l + 1) * 576]
        assert rel_err(feat, ref.hidden_states[l + 1]) < 1e-4, l


def test_smollm2_greedy_64_tokens_match_hf(smollm2_pair):
    hf, ours, tok = smollm2_pair
    ids = torch.tensor([tok("The history of the Roman empire", return_tensors=None)["input_ids"]])
    res = Engine(ours).generate([ids[0].tolist()], SamplingParams(max_tokens=64, ignore_eos=True), "ar")[0]
    with torch.no_grad():
        assert res.token_ids == hf_greedy(hf, ids, 64)
