"""Shared fixtures: tiny random targets/drafters (fast) and the real SmolLM2 pipeline (session-scoped)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(int(os.environ.get("DFLASH_TEST_THREADS", "2")))


def tiny_hf_config(model_type: str = "llama", vocab: int = 96, layers: int = 4, **overrides):
    """A transformers config for a tiny random model (hidden 64, 4 heads / 2 KV heads)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    common.update(overrides)
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen2": Qwen2Config, "mistral": MistralConfig}[model_type]
    if model_type == "mistral":
        common.setdefault("sliding_window", None)  # MistralConfig's default is 4096; a window is asked for by name
    cfg = cls(**common)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                          "mistral": "MistralForCausalLM"}[model_type]]
    return cfg


def make_hf_model(tmp_path, model_type="llama", seed=0, **overrides):
    """Random HF model saved under tmp_path; returns (hf_model, folder)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # larger init than HF's 0.02 so logits are far from uniform (sharper, more realistic tests)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    folder = tmp_path / f"{model_type}-{seed}"
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


@pytest.fixture(scope="session")
def smollm2_path():
    from dflash_trt.models.default import default_target_path

    return default_target_path()


@pytest.fixture(scope="session")
def smollm2_pipeline():
    """SmolLM2-135M-Instruct + the default drafter, float32, a chain with every draft verified
    (draft_confidence 0, tree_topk 1, prompt_lookup 0, max_concurrency None: the tests count full
    blocks; the CPU defaults "auto" have their own tests)."""
    from dflash_trt.api import load_pipeline

    return load_pipeline(dtype="float32", draft_confidence=0.0, tree_topk=1, prompt_lookup=0, max_concurrency=None)


@pytest.fixture(scope="session")
def untrained_drafter(tmp_path_factory, smollm2_path):
    """An untrained 1-layer block-16 drafter for SmolLM2 (parity must not depend on drafter quality)."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter, new_drafter_config

    cfg = new_drafter_config(TargetConfig.from_pretrained(smollm2_path), 1, 16, 16)
    return init_drafter(cfg, tmp_path_factory.mktemp("drafter") / "untrained", seed=0)


@pytest.fixture(scope="session")
def smollm2_untrained(smollm2_path, untrained_drafter):
    from dflash_trt.api import load_pipeline

    return load_pipeline(str(smollm2_path), str(untrained_drafter), dtype="float32", draft_confidence=0.0, tree_topk=1,
                         prompt_lookup=0, max_concurrency=None)


def run_main(monkeypatch, capsys, *args):
    """Run the `dflash-trt` CLI in-process with `args`: (exit code, stdout, stderr)."""
    import sys

    from dflash_trt.cli import main

    monkeypatch.setattr(sys, "argv", ["dflash-trt", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err
