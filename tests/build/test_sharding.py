"""Per-rank shards: our split rules reproduce ModelOpt's own tensor-parallel export exactly, and
reassembling any tp-way checkpoint gives back the unsharded tensors exactly (tp 1 and 3; none / FP8 / NVFP4)."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_trt.build.quantize import calibration_token_ids, hf_forward_loop, quantize_model
from dflash_trt.build.sharding import (
    QKV,
    REPLICATED,
    ROW,
    ShardSpec,
    check_divisible,
    merge_state_dicts,
    rule_for,
    split_state_dict,
    tensors_equal,
)
from dflash_trt.errors import ConfigError


def modelopt_export(model, folder, tp, decoder_type="llama"):
    """ModelOpt's own tp-way export of `model` (the reference our split must reproduce): (config, [rank tensors])."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    export_tensorrt_llm_checkpoint(copy.deepcopy(model), decoder_type, torch.bfloat16, str(folder),
                                   inference_tensor_parallel=tp)
    cfg = json.loads((folder / "config.json").read_text())
    return cfg, [load_file(str(folder / f"rank{r}.safetensors")) for r in range(tp)]


@pytest.fixture(scope="module", params=["none", "fp8", "nvfp4"])
def exports(request, tiny_pair, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, _ = tiny_pair
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    prompts = calibration_token_ids(AutoTokenizer.from_pretrained(str(target)), 4)
    model = quantize_model(model, request.param, "auto", hf_forward_loop(prompts))
    tmp = tmp_path_factory.mktemp(f"exp-{request.param}")
    cfg1, (full,) = modelopt_export(model, tmp / "tp1", 1)
    cfg3, ranks3 = modelopt_export(model, tmp / "tp3", 3)
    return request.param, cfg1, full, cfg3, ranks3


def test_split_matches_modelopt_tp3_export_exactly(exports):
    quant, cfg1, full, cfg3, ranks3 = exports
    assert cfg3["mapping"] == {"world_size": 3, "tp_size": 3, "pp_size": 1}
    ours = split_state_dict(full, ShardSpec.from_trtllm_config(cfg1, 3))
    for r in range(3):
        assert set(ours[r]) == set(ranks3[r])
        for name, t in ranks3[r].items():
            assert tensors_equal(ours[r][name], t), (quant, r, name)
    qkv = ranks3[0]["transformer.layers.0.attention.qkv.weight"]
    assert qkv.shape[0] == (2 + 1 + 1) * 16  # 2 q heads + 1 k head + 1 v head per rank, head_dim 16
    if quant == "nvfp4":
        assert qkv.dtype == torch.uint8 and qkv.shape[1] == 96 // 2  # two E2M1 values per byte
        assert ranks3[0]["transformer.layers.0.mlp.proj.weights_scaling_factor"].shape == (96, 192 // 3 // 16)


@pytest.mark.parametrize("tp", [1, 3])
def test_reassembled_shards_equal_the_unsharded_tensors(exports, tp):
    quant, cfg1, full, cfg3, ranks3 = exports
    spec = ShardSpec.from_trtllm_config(cfg1, tp)
    ranks = [full] if tp == 1 else ranks3
    merged = merge_state_dicts(ranks, spec)
    assert set(merged) == set(full)
    for name, t in full.items():
        assert tensors_equal(merged[name], t), (quant, name)
    assert merge_state_dicts(split_state_dict(full, spec), spec).keys() == full.keys()


def test_rules():
    t = torch.zeros(4, 4)
    assert rule_for("transformer.layers.3.attention.qkv.weight", t) == QKV
    assert rule_for("transformer.layers.3.mlp.proj.weight", t) == ROW
    assert rule_for("transformer.layers.3.mlp.fc.weights_scaling_factor", torch.zeros(1)) == REPLICATED
    assert rule_for("transformer.layers.3.input_layernorm.weight", torch.zeros(4)) == REPLICATED
    assert rule_for("transformer.layers.3.attention.q_layernorm.weight", torch.zeros(128)) == REPLICATED
    assert rule_for("transformer.layers.3.attention.k_layernorm.weight", torch.zeros(128)) == REPLICATED


def test_kv_heads_fewer_than_ranks_are_replicated_and_reassemble():
    spec = ShardSpec(tp_size=4, num_attention_heads=8, num_key_value_heads=2, head_dim=2)
    full = {"transformer.layers.0.attention.qkv.weight": torch.arange(12 * 2 * 3.0).view(24, 3)}
    ranks = split_state_dict(full, spec)
    qkv = [r["transformer.layers.0.attention.qkv.weight"] for r in ranks]
    assert [q.shape[0] for q in qkv] == [8, 8, 8, 8]  # 2 q heads + 1 k + 1 v (replicated) of 2 rows each
    assert torch.equal(qkv[0][4:6], qkv[1][4:6]) and not torch.equal(qkv[0][4:6], qkv[2][4:6])
    assert torch.equal(merge_state_dicts(ranks, spec)["transformer.layers.0.attention.qkv.weight"],
                       full["transformer.layers.0.attention.qkv.weight"])


def test_indivisible_tp_is_refused_with_the_dimension_named():
    with pytest.raises(ConfigError, match="6 attention heads are not divisible by tp 4"):
        check_divisible(ShardSpec(4, 6, 3, 16), 49152, 192, 96)
    with pytest.raises(ConfigError, match=r"NVFP4 row-parallel shards must hold whole 16-element blocks: intermediate "
                                          r"120 / 3 = 40 is not a multiple of 16\."):
        check_divisible(ShardSpec(3, 9, 3, 16), 49152, 120, 144, nvfp4=True)
    # only the width that fails is named (Qwen2.5-7B's shape at tp 8 also has 28 heads, named first)
    with pytest.raises(ConfigError, match=r"NVFP4 row-parallel shards must hold whole 16-element blocks: attention "
                                          r"width 448 / 8 = 56 is not a multiple of 16\."):
        check_divisible(ShardSpec(8, 28, 4, 16), 49152, 1280, 448, nvfp4=True)
    # SmolLM2's shape (9 heads, 3 KV heads, intermediate 1536, vocab 49152): 9 divides the heads but not
    # the MLP or the vocabulary, and the message lists the sizes that fit
    with pytest.raises(ConfigError, match=r"intermediate size 1536 is not divisible by tp 9; vocab size 49152 is not "
                                          r"divisible by tp 9\. Pick a --tp-size that divides all of these; for this "
                                          r"model: 1, 3$"):
        check_divisible(ShardSpec(9, 9, 3, 64), 49152, 1536, 576)
    check_divisible(ShardSpec(3, 9, 3, 64), 49152, 1536, 576)  # fits: no error
    with pytest.raises(ConfigError, match="--tp-size must be >= 1, got 0"):
        check_divisible(ShardSpec(0, 9, 3, 64), 49152, 1536, 576)
