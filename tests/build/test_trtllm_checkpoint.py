"""The per-rank TensorRT-LLM checkpoint of Qwen3 targets (`export_trtllm_checkpoint`, ModelOpt decoder type
`qwen`): config.json has the fields TensorRT-LLM's QWenConfig reads, Qwen3's q/k layernorms are on every
rank whole, and the tp-2 shards reassemble to the tp-1 export exactly (none / FP8 / NVFP4)."""

import pytest
import torch
from test_sharding import modelopt_export

from dflash_trt.build.quantize import calibration_token_ids, hf_forward_loop, quantize_model
from dflash_trt.build.sharding import ShardSpec, merge_state_dicts, split_state_dict, tensors_equal
from dflash_trt.build.trtllm import export_trtllm_checkpoint, read_trtllm_ranks, trtllm_config_fields
from dflash_trt.config import TargetConfig
from dflash_trt.errors import BuildError

QK_NORMS = [f"transformer.layers.{i}.attention.{n}_layernorm.weight" for i in range(4) for n in "qk"]


@pytest.fixture(scope="module", params=["none", "fp8", "nvfp4"])
def qwen3_exports(request, tiny_qwen3_pair, tmp_path_factory):
    """(quant, HF model, tp-1 (config, ranks), tp-2 (config, ranks), ModelOpt's own tp-2 ranks)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, _ = tiny_qwen3_pair
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    prompts = calibration_token_ids(AutoTokenizer.from_pretrained(str(target)), 4)
    kv = "fp8" if request.param == "fp8" else "auto"
    model = quantize_model(model, request.param, kv, hf_forward_loop(prompts))
    tmp = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    out = {}
    for tp in (1, 2):
        export_trtllm_checkpoint(model, tmp / f"tp{tp}", tp, tmp, max_draft_len=3, max_seq_len=256)
        out[tp] = read_trtllm_ranks(tmp / f"tp{tp}")
    _, modelopt_ranks = modelopt_export(model, tmp / "modelopt-tp2", 2, decoder_type="qwen")
    return request.param, model, out[1], out[2], modelopt_ranks


def test_config_has_what_tensorrt_llm_qwen_reads(qwen3_exports):
    quant, _, (cfg1, _), (cfg2, ranks2), _ = qwen3_exports
    assert cfg1["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert cfg2["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1} and len(ranks2) == 2
    for key, value in {"architecture": "Qwen3ForCausalLM", "qwen_type": "qwen3", "qk_layernorm": True,
                       "attn_bias": False, "mlp_bias": False, "rotary_base": 1e6, "rotary_scaling": None,
                       "seq_length": 8192, "use_logn_attn": False, "head_size": 32, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "hidden_size": 96, "intermediate_size": 192,
                       "vocab_size": 49152, "dtype": "bfloat16"}.items():
        assert cfg2[key] == value, key
    assert cfg2["quantization"]["quant_algo"] == {"none": None, "fp8": "FP8", "nvfp4": "NVFP4"}[quant]
    assert cfg2["quantization"]["kv_cache_quant_algo"] == ("FP8" if quant == "fp8" else None)


def test_lm_head_stays_unquantized(qwen3_exports):
    """Our quantization configs leave lm_head alone (ModelOpt's export still warns 'Enable lm_head
    quantization', which `export_trtllm_checkpoint` silences): bfloat16, no scaling factors."""
    quant, _, (cfg1, (full,)), _, _ = qwen3_exports
    assert full["lm_head.weight"].dtype == torch.bfloat16 and full["lm_head.weight"].shape == (49152, 96)
    assert not [k for k in full if k.startswith("lm_head.") and k != "lm_head.weight"]
    assert cfg1["quantization"].get("exclude_modules") is None or "lm_head" in cfg1["quantization"]["exclude_modules"]


def test_qk_layernorms_are_whole_and_identical_on_every_rank(qwen3_exports):
    _, model, (_, (full,)), (_, ranks2), _ = qwen3_exports
    for i, layer in enumerate(model.model.layers):
        for n, hf in (("q", layer.self_attn.q_norm.weight), ("k", layer.self_attn.k_norm.weight)):
            name = f"transformer.layers.{i}.attention.{n}_layernorm.weight"
            assert full[name].shape == (32,) and full[name].dtype == torch.bfloat16
            assert torch.equal(full[name], hf.detach().to(torch.bfloat16))
            assert all(tensors_equal(r[name], full[name]) for r in ranks2), name
    assert not torch.equal(full[QK_NORMS[0]], full[QK_NORMS[1]])  # random norms: a swap would show


def test_tp2_shards_reassemble_to_the_tp1_export_exactly(qwen3_exports):
    quant, _, (cfg1, (full,)), (_, ranks2), _ = qwen3_exports
    spec = ShardSpec.from_trtllm_config(cfg1, 2)
    merged = merge_state_dicts(ranks2, spec)
    assert set(merged) == set(full) and set(QK_NORMS) <= set(full)
    for name, t in full.items():
        assert tensors_equal(merged[name], t), (quant, name)
    qkv = ranks2[0]["transformer.layers.0.attention.qkv.weight"]
    assert qkv.shape[0] == (2 + 1 + 1) * 32  # per rank: 2 q heads + 1 k head + 1 v head of head_dim 32
    assert ranks2[1]["transformer.layers.0.attention.dense.weight"].shape[1] == (128 // 2 if quant != "nvfp4" else 128 // 4)


def test_our_split_matches_modelopts_own_tp2_export(qwen3_exports):
    quant, _, (cfg1, (full,)), _, modelopt_ranks = qwen3_exports
    ours = split_state_dict(full, ShardSpec.from_trtllm_config(cfg1, 2))
    for r in range(2):
        assert set(ours[r]) == set(modelopt_ranks[r])
        for name, t in modelopt_ranks[r].items():
            assert tensors_equal(ours[r][name], t), (quant, r, name)


def test_rope_fields_come_from_rope_parameters():
    """transformers >= 5 keeps RoPE in `rope_parameters`, where ModelOpt 0.47 does not look."""
    smollm2_like = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    fields = trtllm_config_fields(TargetConfig.from_hf_config(smollm2_like))
    assert fields == {"architecture": "LlamaForCausalLM", "rotary_base": 100000.0, "rotary_scaling": None,
                      "attn_bias": False, "mlp_bias": False}
    llama3 = {**smollm2_like, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 8192}}
    scaling = trtllm_config_fields(TargetConfig.from_hf_config(llama3))["rotary_scaling"]
    assert scaling == {"rope_type": "llama3", "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_other_decoders_are_refused_by_name(tmp_path):
    from transformers import AutoModelForCausalLM, GemmaConfig

    cfg = GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(BuildError, match="wired up for llama, qwen3, qwen2, mistral targets only, got model_type "
                                         "'gemma'"):
        export_trtllm_checkpoint(model, tmp_path / "out", 1, tmp_path, max_draft_len=3, max_seq_len=64)
    assert not (tmp_path / "out").exists()


def test_trtllms_drafter_is_stored_in_the_serving_dtype(tmp_path):
    """trtllm/drafter in bfloat16 whatever the drafter's float dtype (TensorRT-LLM builds the draft model in its
    config's dtype beside a bfloat16 target): float32 and float16 weights converted, int tensors (d2t) and
    bfloat16 ones kept; config.json says dtype bfloat16, no torch_dtype; a folder already in bfloat16 is left
    byte for byte."""
    import json

    from safetensors.torch import load_file, save_file

    from dflash_trt.build.trtllm import drafter_in_serving_dtype

    weights = {"fc.weight": torch.randn(4, 8), "norm.weight": torch.randn(8).half(),
               "layers.0.mlp.up_proj.weight": torch.randn(8, 8).bfloat16(), "d2t": torch.arange(5)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "torch_dtype": "float32"}))
    drafter_in_serving_dtype(tmp_path)
    got = load_file(str(tmp_path / "model.safetensors"))
    assert {k: t.dtype for k, t in got.items()} == {"fc.weight": torch.bfloat16, "norm.weight": torch.bfloat16,
                                                   "layers.0.mlp.up_proj.weight": torch.bfloat16, "d2t": torch.int64}
    assert all(torch.equal(got[k], weights[k].to(got[k].dtype)) for k in got)
    assert json.loads((tmp_path / "config.json").read_text()) == {"architectures": ["DFlashDraftModel"],
                                                                   "dtype": "bfloat16"}
    before = (tmp_path / "model.safetensors").read_bytes()
    drafter_in_serving_dtype(tmp_path)  # nothing left to convert: the weights file is not rewritten
    assert (tmp_path / "model.safetensors").read_bytes() == before
