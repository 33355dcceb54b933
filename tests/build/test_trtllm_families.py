"""Qwen2 (Qwen2.5) and Mistral targets in the bundle: TensorRT-LLM's per-rank checkpoint has the fields its
QWenConfig (qwen_type qwen2: a fused qkv bias, no dense bias) and LLaMAConfig (MODEL_MAP's "MistralForCausalLM")
read, the qkv bias is split with its heads exactly as ModelOpt's own tp-2 export splits it, trtllm/target keeps
the Hugging Face architecture the PyTorch backend registers, and a target with a sliding window is refused before
anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from build_helpers import QWEN3_TINY, assert_greedy_dflash_equals_ar, build_bundle, write_tiny_drafter, write_tiny_target
from test_sharding import modelopt_export

from dflash_trt.build.sharding import ShardSpec, merge_state_dicts, split_state_dict, tensors_equal
from dflash_trt.build.trtllm import export_trtllm_checkpoint, read_trtllm_ranks
from dflash_trt.errors import ConfigError

#: model_type -> (ModelOpt decoder type, TensorRT-LLM architecture, config fields beyond the common ones)
FAMILIES = {"qwen2": ("qwen", "Qwen2ForCausalLM", {"qwen_type": "qwen2", "attn_bias": True, "seq_length": 8192,
                                                    "use_logn_attn": False}),
            "mistral": ("llama", "MistralForCausalLM", {"attn_bias": False})}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_export(request, tmp_path_factory, smollm2_path):
    """(model_type, HF model, tp-1 (config, ranks), tp-2 (config, ranks), ModelOpt's own tp-2 ranks); unquantized."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp(request.param)
    window = {"sliding_window": None} if request.param == "mistral" else {}
    target = write_tiny_target(tmp / "target", smollm2_path, model_type=request.param, **QWEN3_TINY, **window)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    out = {tp: (export_trtllm_checkpoint(model, tmp / f"tp{tp}", tp, tmp, max_draft_len=3, max_seq_len=256),
                read_trtllm_ranks(tmp / f"tp{tp}")[1]) for tp in (1, 2)}
    _, modelopt_ranks = modelopt_export(model, tmp / "modelopt-tp2", 2, decoder_type=FAMILIES[request.param][0])
    return request.param, model, out[1], out[2], modelopt_ranks


def test_config_has_what_tensorrt_llm_reads(family_export):
    model_type, _, _, (cfg, ranks), _ = family_export
    _, arch, extra = FAMILIES[model_type]
    assert cfg["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1} and len(ranks) == 2
    expected = {"architecture": arch, "mlp_bias": False, "rotary_base": 1e6, "rotary_scaling": None, "head_size": 32,
                "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 96, "intermediate_size": 192,
                "dtype": "bfloat16", **extra}
    assert {k: cfg.get(k) for k in expected} == expected
    if model_type == "mistral":
        assert "qwen_type" not in cfg


def test_qkv_bias_is_split_with_its_heads(family_export):
    """Qwen2: rank r's fused qkv bias is [q heads 2r, 2r + 1; k head r; v head r] of HF's q/k/v_proj biases, and
    attention.dense has no bias (HF's o_proj has none); Mistral: no bias anywhere."""
    model_type, model, (_, (full,)), (_, ranks), _ = family_export
    biases = sorted(k for k in full if k.endswith(".bias"))
    if model_type == "mistral":
        assert biases == []
        return
    assert biases == [f"transformer.layers.{i}.attention.qkv.bias" for i in range(4)]
    attn = model.model.layers[1].self_attn
    q, k, v = (p.bias.detach().to(torch.bfloat16) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    for r in range(2):
        want = torch.cat([q[r * 64:(r + 1) * 64], k[r * 32:(r + 1) * 32], v[r * 32:(r + 1) * 32]])
        assert torch.equal(ranks[r]["transformer.layers.1.attention.qkv.bias"], want)
    assert not torch.equal(ranks[0]["transformer.layers.1.attention.qkv.bias"],
                           ranks[1]["transformer.layers.1.attention.qkv.bias"])


def test_tp2_matches_modelopts_own_export_and_reassembles(family_export):
    _, _, (cfg1, (full,)), (_, ranks), modelopt_ranks = family_export
    spec = ShardSpec.from_trtllm_config(cfg1, 2)
    for r in range(2):
        assert set(ranks[r]) == set(modelopt_ranks[r])
        for name, t in modelopt_ranks[r].items():
            assert tensors_equal(ranks[r][name], t), (r, name)
    merged = merge_state_dicts(ranks, spec)
    assert all(tensors_equal(merged[k], t) for k, t in full.items())
    assert all(tensors_equal(a, b) for sd, ref in zip(split_state_dict(full, spec), ranks) for a, b in
               ((sd[k], ref[k]) for k in ref))


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_bundle_keeps_the_hf_architecture_and_decodes_losslessly(tmp_path, smollm2_path, model_type):
    """trtllm/target is the Hugging Face checkpoint TensorRT-LLM's PyTorch backend loads by architecture
    (Qwen2ForCausalLM / MistralForCausalLM are registered there, and their decoder layers hand DFlash its target
    features); FP8 at tp 2; the bundle itself decodes greedy DFlash == AR."""
    from safetensors import safe_open

    from dflash_trt.api import load_bundle
    from dflash_trt.build.manifest import load_manifest

    window = {"sliding_window": None} if model_type == "mistral" else {}
    target = write_tiny_target(tmp_path / "target", smollm2_path, model_type=model_type, **QWEN3_TINY, **window)
    out = tmp_path / "bundle"
    build_bundle(target, write_tiny_drafter(tmp_path / "drafter", target), out, quant="fp8", tp_size=2)
    arch = FAMILIES[model_type][1]
    assert json.loads((out / "trtllm/target/config.json").read_text())["architectures"] == [arch]
    assert load_manifest(out)["models"]["target"]["trtllm_checkpoint_architecture"] == arch
    names = set()
    for f in (out / "trtllm/target").glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    has_bias = {p: f"model.layers.0.self_attn.{p}.bias" in names for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert has_bias == {"q_proj": model_type == "qwen2", "k_proj": model_type == "qwen2",
                        "v_proj": model_type == "qwen2", "o_proj": False}
    assert_greedy_dflash_equals_ar(load_bundle(out))


def test_a_sliding_window_target_is_refused_before_anything_is_written(tmp_path, smollm2_path):
    from transformers import AutoModelForCausalLM

    target = write_tiny_target(tmp_path / "target", smollm2_path, model_type="mistral", sliding_window=64)
    drafter = write_tiny_drafter(tmp_path / "drafter", target)
    with pytest.raises(ConfigError, match=r"sliding window of 64 positions on 4 of 4 layers \(config.json's "
                                          r"sliding_window\).*dflash-trt generate / serve.*fits in 64 tokens.*"
                                          r"sets sliding_window null and max_position_embeddings 64 \(serve.yaml's "
                                          r"max_seq_len comes from it"):
        build_bundle(target, drafter, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"sliding window of 64 positions.*\(the engine flow's config has no window "
                                          r"field \(TensorRT-LLM's PyTorch Mistral model applies it, but the bundle "
                                          r"holds both\)\)"):
        export_trtllm_checkpoint(model, tmp_path / "ckpt", 1, tmp_path, max_draft_len=3, max_seq_len=256)
    assert not (tmp_path / "ckpt").exists()
