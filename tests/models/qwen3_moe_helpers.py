"""Tiny random Qwen3-MoE targets for the tests (transformers' Qwen3MoeConfig / Qwen3MoeForCausalLM, saved with
save_pretrained), importable by a unique name from any test folder."""

from __future__ import annotations

import torch

from tests.build.build_helpers import copy_tokenizer

#: 4 layers (layer 1 dense: mlp_only_layers), 8 experts of width 32, top-2; tp 2 divides heads, KV heads,
#: the dense MLP (96) and the experts (32)
MOE_TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=512, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def make_moe_model(folder, seed: int = 0, tokenizer_from=None, **overrides):
    """A random tiny Qwen3MoeForCausalLM (MOE_TINY with `overrides`) saved in `folder` (float32), with the
    tokenizer files of `tokenizer_from` (a model folder, e.g. SmolLM2's: then give its vocab_size) copied
    beside it. Weights are drawn wider than HF's init (normal(0, 0.15); q/k norms in [0.5, 1.5]) so logits
    and routing are far from uniform. Returns (hf_model in eval mode, folder)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**{**MOE_TINY, **overrides})
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
            elif ".q_norm." in name or ".k_norm." in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, folder)
    return model, folder


def write_moe_drafter(folder, target_folder, **changes):
    """An untrained 1-layer block-4 drafter (`init_drafter`) for the target in `target_folder`, reading target
    layers 1 and 2."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter, new_drafter_config

    cfg = new_drafter_config(TargetConfig.from_pretrained(target_folder), num_layers=1, block_size=4,
                             mask_token_id=16, target_layer_ids=[1, 2])
    return init_drafter(cfg.replace(**changes), folder, seed=1)
