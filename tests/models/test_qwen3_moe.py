"""Qwen3-MoE targets (model_type "qwen3_moe"): config fields, our sparse MoE layers vs transformers'
Qwen3MoeForCausalLM (prefill and KV-cached decode steps), and lossless greedy DFlash on such a target."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dflash_trt.config import TargetConfig
from dflash_trt.errors import ConfigError
from dflash_trt.models.checkpoints import load_target
from dflash_trt.models.layers import SwiGLU
from dflash_trt.models.moe import SparseMoeBlock
from tests.models.qwen3_moe_helpers import MOE_TINY, make_moe_model, write_moe_drafter


def hf_step_logits(hf, ids: torch.Tensor, steps: list[int]) -> list[torch.Tensor]:
    """transformers' logits of the prompt `ids` [1, t], then of each token of `steps` fed one at a time with its
    KV cache: [prompt logits [1, t, V], step logits [1, 1, V], ...]."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = hf(ids, past_key_values=cache, use_cache=True)
    logits = [out.logits]
    for tok in steps:
        out = hf(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits)
    return logits


def our_step_logits(model, ids: torch.Tensor, steps: list[int]) -> list[torch.Tensor]:
    """Ours, the same passes as `hf_step_logits` over our KV cache."""
    t = ids.shape[1]
    cache = model.new_cache(1, t + len(steps))
    logits = [model(ids, torch.arange(t)[None], cache, t).logits]
    for i, tok in enumerate(steps):
        pos = t + i
        logits.append(model(torch.tensor([[tok]]), torch.tensor([[pos]]), cache, pos + 1).logits)
    return logits


@pytest.mark.parametrize("overrides, want_sparse", [
    ({}, [True, False, True, True]),  # layer 1 dense (mlp_only_layers), renormalized top-2
    ({"norm_topk_prob": False, "mlp_only_layers": [], "num_experts_per_tok": 3}, [True] * 4),
    ({"decoder_sparse_step": 2, "mlp_only_layers": []}, [False, True, False, True]),
])
def test_logits_match_transformers_for_a_prompt_and_cached_decode_steps(tmp_path, overrides, want_sparse):
    hf, folder = make_moe_model(tmp_path / "moe", **overrides)
    ours = load_target(folder)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert sparse == want_sparse == [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert all(isinstance(layer.mlp, SwiGLU) for layer, s in zip(ours.model.layers, sparse) if not s)
    ids = torch.randint(3, 96, (1, 19), generator=torch.Generator().manual_seed(1))
    steps = [5, 77, 31, 8, 60]
    with torch.no_grad():
        ref, out = hf_step_logits(hf, ids, steps), our_step_logits(ours, ids, steps)
    for r, o in zip(ref, out):
        torch.testing.assert_close(o, r, rtol=0, atol=2e-5)
    assert float(ref[0].abs().max()) > 1  # logits far from uniform: the comparison means something


def test_routing_weights_and_only_routed_experts_run(tmp_path):
    """Each token runs exactly its top-k experts (the others are never called), with transformers' routing
    weights (softmax in float32, top-k, renormalized by norm_topk_prob)."""
    hf, folder = make_moe_model(tmp_path / "moe")
    ours = load_target(folder)
    block, ref = ours.model.layers[0].mlp, hf.model.layers[0].mlp
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        weights, experts = block.route(x)
        _, ref_weights, ref_experts = ref.gate(x)
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    calls = []
    for e, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda _m, args, _o, e=e: calls.append((e, args[0].shape[0])))
    with torch.no_grad():
        block(x[:1])
    assert sorted(calls) == sorted((int(e), 1) for e in experts[0])


def test_a_verify_pass_gives_each_token_the_values_of_one_token_steps(tmp_path):
    """Routing per token: a 6-token pass over the cache gives each token the logits of 6 one-token steps (the
    property lossless DFlash verification rests on)."""
    _, folder = make_moe_model(tmp_path / "moe")
    model = load_target(folder)
    ids = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        one = model.new_cache(1, 16)
        model(ids[:, :10], torch.arange(10)[None], one, 10)
        block = model(ids[:, 10:], torch.arange(10, 16)[None], one, 16).logits
        steps = our_step_logits(model, ids[:, :10], ids[0, 10:].tolist())
    torch.testing.assert_close(block[0], torch.cat([s[0] for s in steps[1:]]), rtol=0, atol=1e-5)


def test_greedy_dflash_equals_autoregressive_on_a_moe_target(tmp_path):
    from dflash_trt.api import load_pipeline
    from dflash_trt.runtime.sampling import SamplingParams

    _, target = make_moe_model(tmp_path / "moe")
    drafter = write_moe_drafter(tmp_path / "drafter", target)
    pipe = load_pipeline(str(target), str(drafter), "float32", draft_confidence=0.0, tree_topk=1, prompt_lookup=3,
                         max_concurrency=None)
    prompts = [[1, 40, 41, 42, 40, 41, 42, 40], [9, 8, 7, 6], [50, 3]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    spec = pipe.generate(prompts, params, mode="dflash")
    ar = pipe.generate(prompts, params, mode="ar")
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    assert all(len(r.token_ids) == 24 for r in spec)
    assert sum(r.metrics.accepted_tokens for r in spec) > 0  # drafts were accepted: verify kept several tokens
    assert sum(r.metrics.verify_steps for r in spec) < 3 * 24


def test_config_fields_defaults_and_the_transformers_5_expert_count_name():
    base = {"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 4, "num_attention_heads": 4}
    cfg = TargetConfig.from_hf_config(base)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
            cfg.decoder_sparse_step, cfg.mlp_only_layers, cfg.qk_norm) == (128, 8, 768, False, 1, (), True)
    assert cfg.is_moe and all(cfg.is_sparse_layer(i) for i in range(4))
    cfg = TargetConfig.from_hf_config({**base, "num_local_experts": 6, "num_experts_per_tok": 2,
                                       "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.num_experts == 6 and [cfg.is_sparse_layer(i) for i in range(4)] == [False, True, False, False]
    assert not TargetConfig.from_hf_config({**base, "num_experts": 0}).is_moe  # every layer dense, as transformers
    qwen3 = TargetConfig.from_hf_config({**base, "model_type": "qwen3"})
    assert qwen3.num_experts == 0 and not qwen3.is_moe  # other families: no MoE fields read


def test_tensor_parallel_splits_the_dense_width_only_where_a_layer_is_dense():
    """Qwen3-30B-A3B's layers are all sparse: its intermediate_size (a width no layer uses) need not divide
    tp_size; one dense layer (mlp_only_layers) makes it count."""
    from dflash_trt.build.sharding import ShardSpec, check_divisible
    from dflash_trt.runtime.tensor_parallel import check_target_tp

    base = {"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 66,
            "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4}
    sparse = TargetConfig.from_hf_config(base)
    assert sparse.dense_intermediate_size == 0
    check_target_tp(sparse, 4)
    check_divisible(ShardSpec(4, 4, 4, 16), 96, sparse.dense_intermediate_size, 64)
    mixed = TargetConfig.from_hf_config({**base, "mlp_only_layers": [2]})
    assert mixed.dense_intermediate_size == 66
    with pytest.raises(ConfigError, match=r"^tp_size 4 does not divide the target's MLP intermediate features \(66\); "
                                          r"use a tp_size that divides them: 1, 2$"):
        check_target_tp(mixed, 4)
    with pytest.raises(ConfigError, match=r"intermediate size 66 is not divisible by tp 4"):
        check_divisible(ShardSpec(4, 4, 4, 16), 96, mixed.dense_intermediate_size, 64)
    with pytest.raises(ConfigError, match=r"expert MLP intermediate features \(32\)"):
        check_target_tp(sparse, 3)


@pytest.mark.parametrize("change, words", [
    ({"num_experts": "8"}, r"'num_experts' must be an integer, got '8'"),
    ({"num_experts": -1}, r"'num_experts' must be at least 0, got -1"),
    ({"num_experts": 4, "num_experts_per_tok": 5}, r"'num_experts_per_tok' 5 is more than the 4 experts"),
    ({"num_experts_per_tok": 0}, r"'num_experts_per_tok' must be at least 1, got 0"),
    ({"moe_intermediate_size": 0}, r"'moe_intermediate_size' must be at least 1, got 0"),
    ({"norm_topk_prob": "yes"}, r"'norm_topk_prob' must be true or false, got 'yes'"),
    ({"decoder_sparse_step": 0}, r"'decoder_sparse_step' must be at least 1, got 0"),
    ({"mlp_only_layers": 1}, r"'mlp_only_layers' must be a list of layer indices \(e.g. \[0, 1\]\), got 1"),
    ({"mlp_only_layers": [0, 4]}, r"'mlp_only_layers' \[0, 4\] names a layer beyond the 4 decoder layers "
                                  r"\(indices 0 to 3\)"),
    ({"mlp_only_layers": [-1]}, r"'mlp_only_layers' must be at least 0, got -1"),
])
def test_bad_moe_fields_are_named(tmp_path, change, words):
    _, folder = make_moe_model(tmp_path / "moe")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("num_local_experts")
    (folder / "config.json").write_text(json.dumps({**cfg, "num_experts": 8, **change}))
    with pytest.raises(ConfigError, match=words):
        load_target(folder)


def test_a_checkpoint_missing_an_expert_is_named(tmp_path):
    from dflash_trt.errors import CheckpointError
    from tests.build.build_helpers import drop_tensor

    _, folder = make_moe_model(tmp_path / "moe")
    drop_tensor(folder, "model.layers.2.mlp.experts.7.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"missing key\(s\) model.layers.2.mlp.experts.7.up_proj.weight \[32, 64\]"):
        load_target(folder)
    assert MOE_TINY["moe_intermediate_size"] == 32


def test_a_config_that_misplaces_the_experts_names_the_fields_to_fix(tmp_path):
    """mlp_only_layers naming a layer that holds experts: loading and `dflash-trt check` name the weights and the
    config.json fields that decide which layers are sparse (they said only "wrong model type or config?")."""
    from dflash_trt.compat import ERROR, check_checkpoints
    from dflash_trt.errors import CheckpointError

    _, folder = make_moe_model(tmp_path / "moe")
    drafter = write_moe_drafter(tmp_path / "drafter", folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "mlp_only_layers": [1, 2]}))  # layer 2 holds experts
    fields = (r"for a mixture-of-experts target, config.json's num_experts \(or num_local_experts\), "
              r"moe_intermediate_size, mlp_only_layers and decoder_sparse_step must describe which layers hold "
              r"experts and how many: fix them there")
    with pytest.raises(CheckpointError, match=r"missing key\(s\) model.layers.2.mlp.gate_proj.weight .*" + fields):
        load_target(folder)
    errors = [f.message for f in check_checkpoints(folder, drafter) if f.level == ERROR]
    assert any(re.search(fields + "$", e) for e in errors), errors
    assert any("unexpected key(s) model.layers.2.mlp.experts.0.down_proj.weight" in e for e in errors), errors
