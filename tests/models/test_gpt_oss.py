"""gpt-oss targets (model_type "gpt_oss"): config fields, our layers (attention sinks, alternating sliding /
full layers, YaRN RoPE, biased top-k router, fused experts with the clamped SwiGLU) vs transformers'
GptOssForCausalLM (prefill and KV-cached decode steps), and lossless greedy DFlash (chains, draft trees,
rejected drafts, prefix-cache hits) on such a target."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_trt.config import TargetConfig
from dflash_trt.errors import ConfigError
from dflash_trt.models.checkpoints import load_target
from dflash_trt.models.layers import attention, sink_attention
from dflash_trt.models.moe import GptOssMoeBlock
from tests.models import test_target_families as families
from tests.models.gpt_oss_helpers import GPT_OSS_TINY, make_gpt_oss_model
from tests.models.test_qwen3_moe import hf_step_logits, our_step_logits


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(name, HF model, folder, our TargetModel) of the tiny gpt-oss target, as test_target_families' families."""
    hf, folder = make_gpt_oss_model(tmp_path_factory.mktemp("gpt_oss"), seed=3)
    return "gpt_oss", hf, folder, load_target(folder)


@pytest.mark.parametrize("overrides", [
    {},  # layers 0 and 2 slide (window 5), 1 and 3 full
    {"layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
     "num_experts_per_tok": 3, "sliding_window": 7},
])
def test_logits_match_transformers_for_a_prompt_and_cached_decode_steps(tmp_path, overrides):
    hf, folder = make_gpt_oss_model(tmp_path / "gpt_oss", **overrides)
    ours = load_target(folder)
    assert [layer.self_attn.window for layer in ours.model.layers] == \
        [hf.config.sliding_window if t == "sliding_attention" else None for t in hf.config.layer_types]
    assert all(isinstance(layer.mlp, GptOssMoeBlock) for layer in ours.model.layers)
    ids = torch.randint(3, 96, (1, 19), generator=torch.Generator().manual_seed(1))
    steps = [5, 77, 31, 8, 60]
    with torch.no_grad():
        ref, out = hf_step_logits(hf, ids, steps), our_step_logits(ours, ids, steps)
    for r, o in zip(ref, out):
        torch.testing.assert_close(o, r, rtol=0, atol=2e-5)
    assert float(ref[0].abs().max()) > 1  # logits far from uniform: the comparison means something


def test_the_sinks_window_and_yarn_each_change_the_logits(gpt_oss):
    """Each gpt-oss feature the comparison with transformers covers moves the logits: without it ours would
    differ (so the match above is not by chance)."""
    _, hf, _, ours = gpt_oss
    ids = torch.randint(3, 96, (1, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        base = our_step_logits(ours, ids, [])[0]
        torch.testing.assert_close(base, ref, rtol=0, atol=2e-5)
        attn = ours.model.layers[0].self_attn
        sinks, attn.sinks = attn.sinks, None
        no_sinks = our_step_logits(ours, ids, [])[0]
        attn.sinks, window, attn.window = sinks, attn.window, None
        no_window = our_step_logits(ours, ids, [])[0]
        attn.window = window
    for changed in (no_sinks, no_window):
        assert float((changed - ref).abs().max()) > 1e-2
    assert ours.rotary.attention_factor > 1.1  # YaRN's attention factor at factor 4 (1 + 0.1 ln 4)


def test_moe_block_routes_and_clamps_as_transformers(gpt_oss):
    """One MLP block on wide inputs: transformers' router picks the same experts with the same weights (softmax
    over the top-k logits), and the block's output matches with the SwiGLU clamp active."""
    _, hf, _, ours = gpt_oss
    block, ref = ours.model.layers[0].mlp, hf.model.layers[0].mlp
    x = 3 * torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        weights, experts = block.route(x[0])
        _, ref_weights, ref_experts = ref.router(x[0])
        assert torch.equal(experts, ref_experts)
        torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-6)
        want = ref(x)[0]
        torch.testing.assert_close(block(x), want, rtol=0, atol=1e-6 * float(want.abs().max()))  # float rounding
        gate_up = x[0] @ block.experts.gate_up_proj[int(experts[0, 0])] + block.experts.gate_up_proj_bias[0]
    assert bool((gate_up.abs() > block.experts.limit).any())  # the clamp bites on these inputs


def test_sink_attention_is_attention_with_one_more_logit():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.3
    mask[..., 0] = True
    plain = attention(q, k, v, mask, 0.3)
    torch.testing.assert_close(sink_attention(q, k, v, mask, 0.3, torch.full((4,), -torch.inf)), plain)
    sinks = torch.tensor([0.0, 1.0, -2.0, 3.0])
    # a sink of logit s scales each head's output by Z / (Z + e^s), Z its keys' sum of e^score
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3).masked_fill(~mask, -torch.inf)
    z = scores.exp().sum(-1)  # [2, 4, 5]
    want = plain.view(2, 5, 4, 8) * (z / (z + sinks.exp()[None, :, None])).transpose(1, 2)[..., None]
    torch.testing.assert_close(sink_attention(q, k, v, mask, 0.3, sinks), want.reshape(2, 5, 32))


def test_a_verify_pass_gives_each_token_the_values_of_one_token_steps(gpt_oss):
    _, _, _, model = gpt_oss
    ids = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        one = model.new_cache(1, 16)
        model(ids[:, :10], torch.arange(10)[None], one, 10)
        block = model(ids[:, 10:], torch.arange(10, 16)[None], one, 16).logits
        steps = our_step_logits(model, ids[:, :10], ids[0, 10:].tolist())
    torch.testing.assert_close(block[0], torch.cat([s[0] for s in steps[1:]]), rtol=0, atol=1e-5)


def test_greedy_decoding_matches_transformers_generate(gpt_oss):
    families.test_greedy_decoding_matches_transformers_generate(gpt_oss)


@pytest.mark.parametrize("wrong", [(), (1, 3, 5)])
def test_verify_blocks_with_accepted_and_rejected_drafts_equal_autoregressive(gpt_oss, wrong):
    families.test_verify_blocks_with_accepted_and_rejected_drafts_equal_autoregressive(gpt_oss, wrong)


def test_a_deep_draft_tree_is_masked_by_position_not_slot(gpt_oss):
    families.test_a_deep_draft_tree_is_masked_by_position_not_slot(gpt_oss)


@pytest.mark.parametrize("tree_topk", [1, 3])
def test_dflash_with_an_initialised_drafter_equals_autoregressive(gpt_oss, tmp_path, tree_topk):
    families.test_dflash_with_an_initialised_drafter_equals_autoregressive(gpt_oss, tmp_path, tree_topk)


def test_prefix_cache_hits_give_the_same_tokens(gpt_oss, tmp_path):
    families.test_prefix_cache_hits_on_a_windowed_target_give_the_same_tokens(gpt_oss, tmp_path, 4)


BASE = {"model_type": "gpt_oss", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def test_config_defaults_are_gpt_oss_configs():
    """Fields a config.json may leave out take GptOssConfig's values: window 128 on layers 0, 2, ...; biased
    attention; 128 experts, top-4, as wide as intermediate_size; eps 1e-5; the clamp at 7."""
    cfg = TargetConfig.from_hf_config(BASE)
    assert [cfg.layer_window(i) for i in range(4)] == [128, None, 128, None]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.swiglu_limit) == (128, 4, 32, 7.0)
    assert cfg.attention_bias and cfg.attention_sinks and not cfg.qk_norm and cfg.rms_norm_eps == 1e-5
    assert cfg.is_moe and all(cfg.is_sparse_layer(i) for i in range(4))
    cfg = TargetConfig.from_hf_config({**BASE, "layer_types": ["full_attention"] * 4, "attention_bias": False})
    assert cfg.layer_types == () and cfg.sliding_window is None and not cfg.attention_bias
    assert GPT_OSS_TINY["sliding_window"] == 5


@pytest.mark.parametrize("change, words", [
    ({"num_local_experts": 2, "num_experts_per_tok": 3}, r"'num_experts_per_tok' 3 is more than the 2 experts"),
    ({"num_local_experts": "8"}, r"'num_local_experts' must be an integer, got '8'"),
    ({"swiglu_limit": 0}, r"'swiglu_limit' must be a finite number > 0, got 0"),
    ({"layer_types": ["sliding_attention"] * 3}, r"'layer_types' must list one of .* per layer \(4 entries\)"),
    ({"sliding_window": 0}, r"'sliding_window' must be at least 1, got 0"),
])
def test_bad_gpt_oss_fields_are_named(change, words):
    with pytest.raises(ConfigError, match=words):
        TargetConfig.from_hf_config({**BASE, **change})


def test_a_checkpoint_missing_a_sink_is_named(tmp_path):
    from dflash_trt.errors import CheckpointError
    from tests.build.build_helpers import drop_tensor

    _, folder = make_gpt_oss_model(tmp_path / "gpt_oss")
    drop_tensor(folder, "model.layers.3.self_attn.sinks")
    with pytest.raises(CheckpointError, match=r"missing key\(s\) model.layers.3.self_attn.sinks \[4\]"):
        load_target(folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss"
