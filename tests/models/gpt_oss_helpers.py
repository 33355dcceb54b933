"""Tiny random gpt-oss targets for the tests (transformers' GptOssConfig / GptOssForCausalLM, saved with
save_pretrained), importable by a unique name from any test folder."""

from __future__ import annotations

import shutil

import torch

from tests.build.build_helpers import copy_tokenizer

#: 4 layers alternating sliding (window 5: prompts of 20+ tokens span several) / full, 8 experts of width 32, top-2, YaRN RoPE as openai/gpt-oss-20b
#: sets it (truncate false); tp 2 divides heads, KV heads and the experts
GPT_OSS_TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=5,
                    max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})


def make_gpt_oss_model(folder, seed: int = 0, tokenizer_from=None, **overrides):
    """A random tiny GptOssForCausalLM (GPT_OSS_TINY with `overrides`) saved in `folder` (float32), eager
    attention and experts (transformers' reference paths). Weights are drawn wider than HF's init (normal(0,
    0.15); gate_up_proj normal(0, 0.5), sinks normal(0, 1)) so logits, routing, the SwiGLU clamp and the sinks
    all matter. `tokenizer_from`: a model folder whose tokenizer files are copied beside it (e.g. SmolLM2's: then
    give its vocab_size). Returns (hf_model in eval mode, folder)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    cfg = GptOssConfig(**{**GPT_OSS_TINY, **overrides})
    cfg.architectures = ["GptOssForCausalLM"]
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1)
            elif name.endswith("gate_up_proj"):  # pre-activations of a few units: the SwiGLU clamp at 7 bites
                p.normal_(0, 0.5)
            elif "norm" not in name:
                p.normal_(0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, folder)
    return model, folder


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused expert tensor w [E, in, out] (in a multiple of 32) rounded to MXFP4, in the layout of
    openai/gpt-oss-20b's checkpoint: (blocks uint8 [E, out, in / 32, 16], scales uint8 [E, out, in / 32]). Each
    group of 32 takes the exponent 2^e with e = ceil(log2(amax / 6)), each value the nearest E2M1 magnitude."""
    from dflash_trt.models.dequant import E2M1_VALUES

    groups = w.float().transpose(1, 2).reshape(w.shape[0], w.shape[2], w.shape[1] // 32, 32)
    amax = groups.abs().amax(-1).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(exp), exp.int())[..., None]
    magnitudes = E2M1_VALUES[:8]
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    codes = codes.to(torch.uint8).view(*codes.shape[:-1], 16, 2)
    return codes[..., 0] | (codes[..., 1] << 4), (exp + 127).to(torch.uint8)


def write_mxfp4_copy(folder, out):
    """The checkpoint in `folder` with its experts' gate_up_proj / down_proj stored as MXFP4 (`pack_mxfp4`) and
    config.json's quantization_config as openai/gpt-oss-20b's, written to `out`. Returns out."""
    import json

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    tensors = load_file(folder / "model.safetensors")
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[key + "_blocks"], tensors[key + "_scales"] = pack_mxfp4(tensors.pop(key))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("generation_config.json",):
        if (folder / name).is_file():
            shutil.copy2(folder / name, out / name)
    return out


def write_gpt_oss_drafter(folder, target_folder, **changes):
    """An untrained 1-layer block-4 drafter (`init_drafter`) for the target in `target_folder`, reading target
    layers 1 and 2."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter, new_drafter_config

    cfg = new_drafter_config(TargetConfig.from_pretrained(target_folder), num_layers=1, block_size=4,
                             mask_token_id=16, target_layer_ids=[1, 2])
    return init_drafter(cfg.replace(**changes), folder, seed=1)
