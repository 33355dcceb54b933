"""Helpers for the build tests (kept out of conftest.py so tests can import them by a unique name)."""

from __future__ import annotations

import shutil

import torch

TINY = dict(vocab_size=49152, hidden_size=96, intermediate_size=192, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=3, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
#: overrides of TINY for the Qwen3 target: tp 2 divides the heads, attention width 4 * 32 != hidden 96
QWEN3_TINY = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6)


def write_tiny_target(folder, smollm2_path, seed=0, model_type="llama", **overrides):
    """A random tiny LlamaForCausalLM, Qwen3ForCausalLM, Qwen2ForCausalLM or MistralForCausalLM (+ SmolLM2 tokenizer
    files) saved in `folder`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    torch.manual_seed(seed)
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen2": Qwen2Config, "mistral": MistralConfig}[model_type]
    cfg = cls(**{**TINY, **overrides})
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                          "mistral": "MistralForCausalLM"}[model_type]]
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)  # sharper than HF's init: logits far from uniform
            elif ".q_norm." in name or ".k_norm." in name:
                p.uniform_(0.5, 1.5)  # Qwen3's per-head q/k norms: not all ones, so a lost or mixed-up one shows
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(smollm2_path, folder)
    return folder


def copy_tokenizer(src, folder) -> None:
    """Copy a model folder's tokenizer files (and generation_config.json) into `folder`, those it has."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, folder / name)


def write_tiny_drafter(folder, target_folder, **changes):
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter, new_drafter_config

    cfg = new_drafter_config(TargetConfig.from_pretrained(target_folder), num_layers=1, block_size=4,
                             mask_token_id=16, target_layer_ids=[1, 2])
    return init_drafter(cfg.replace(**changes), folder, seed=1)


def build_bundle(target, drafter, out, **opts):
    from dflash_trt.build.pipeline import BuildOptions, run_build

    return run_build(BuildOptions(target=target, drafter=drafter, out=out, calib_size=opts.pop("calib_size", 4), **opts),
                     log=lambda _line: None)


def assert_greedy_dflash_equals_ar(pipe, max_tokens: int = 24, near_tie: float = 0.0) -> list[list[int]]:
    """Lossless on a loaded bundle: greedy DFlash == greedy AR, token for token, on three fixed prompts
    (code, chat, plain text) decoded together for exactly `max_tokens` tokens. Returns the prompts.

    near_tie > 0 is for W8A8 targets, whose static FP8 activation quantization is discontinuous: a
    last-bit difference between a 1-token decode and a multi-token verify matmul can move one
    activation a whole FP8 step and so change a logit by ~0.1 (measured on the tiny FP8 bundle), which
    flips the argmax where the target's top two logits are that close. Then a row may differ from AR,
    but only from a position where the target's top-2 logit gap (after AR's tokens so far, measured
    by one prefill pass: itself a third matmul shape, close to both) is < near_tie, and identical before it."""
    from dflash_trt.runtime.sampling import SamplingParams

    prompts = [pipe.encode("def fibonacci(n):"), pipe.encode_chat("Name three colours."), pipe.encode("The history of")]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    spec, ar = pipe.generate(prompts, params, "dflash"), pipe.generate(prompts, params, "ar")
    assert all(len(r.token_ids) == max_tokens for r in spec)
    for prompt, s, a in zip(prompts, spec, ar):
        if s.token_ids == a.token_ids:
            continue
        first = next((i for i, (x, y) in enumerate(zip(s.token_ids, a.token_ids)) if x != y), len(a.token_ids))
        gap = top2_gap(pipe, prompt + a.token_ids[:first])
        assert gap < near_tie, (f"DFlash != AR from output token {first} where the target's top-2 logit gap is "
                                f"{gap:.4g} (not a near-tie < {near_tie}): {s.token_ids} vs {a.token_ids}")
    return prompts


def prompt_logits(pipe, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids), vocab] target logits of one prompt (one prefill pass)."""
    model = pipe.engine.target
    cache = model.new_cache(1, len(ids))
    with torch.inference_mode():
        out = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, len(ids))
    return out.logits[0].float()


def top2_gap(pipe, ids: list[int]) -> float:
    """The target's top-1 minus top-2 next-token logit after `ids` (one prefill pass, float32)."""
    top = prompt_logits(pipe, ids)[-1].topk(2).values
    return float(top[0] - top[1])


def drop_tensor(folder, key: str) -> None:
    """Remove tensor `key` from `folder`'s single model.safetensors (a checkpoint missing one weight)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors[key]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
