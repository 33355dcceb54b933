from __future__ import annotations

import json
import re

import pytest

from dflash_trt.config import DrafterConfig, TargetConfig, default_target_layer_ids
from dflash_trt.errors import ConfigError


def test_default_target_layer_ids_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B (z-lab/dflash's released drafter)
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # SmolLM2-135M
    assert default_target_layer_ids(30, 1) == [15]
    # fewer layers than the rule's range holds: each layer once (z-lab's rule repeats them: [1, 1, 1, 1, 1])
    assert default_target_layer_ids(4, 5) == [1] and default_target_layer_ids(6, 5) == [1, 2, 3]
    assert default_target_layer_ids(7, 5) == [1, 2, 3, 4] and default_target_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    for layers in range(4, 40):
        ids = default_target_layer_ids(layers, 5)
        assert ids == sorted(set(ids)) and len(ids) == min(5, layers - 3) and 1 <= ids[0] and ids[-1] <= layers - 3
    with pytest.raises(ConfigError, match="3 layers is too shallow .*give the layers with --target-layer-ids"):
        default_target_layer_ids(3, 5)


def test_rope_layouts_v4_and_v5_agree():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=2)
    v4 = TargetConfig.from_hf_config(dict(base, rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}))
    v5 = TargetConfig.from_hf_config(dict(base, rope_parameters={"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}))
    assert v4 == v5 and v4.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_unsupported_configs_are_named():
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        TargetConfig.from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ConfigError, match=r"target config.json has no model_type: it is not a Hugging Face model's "
                                          r"config.json; give the folder of a Hugging Face model \(Llama, Mistral, "
                                          r"Qwen2, Qwen3, Qwen3-MoE or gpt-oss\) as "
                                          r"--target"):
        TargetConfig.from_hf_config({"hidden_size": 8})
    with pytest.raises(ConfigError, match="rope scaling type 'longrope'"):
        TargetConfig.from_hf_config(dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         rope_scaling={"rope_type": "longrope"}))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        DrafterConfig.from_hf_config({"hidden_size": 8})


def test_swapped_target_and_drafter_configs_are_named():
    """A drafter's config.json read as a target, or a model's read as a drafter, says the two folders
    look swapped (a drafter config parsed as a Qwen3 target before, and a target as a drafter only
    missed target_layer_ids)."""
    drafter = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": 10, "hidden_size": 8,
               "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
               "dflash_config": {"target_layer_ids": [1], "mask_token_id": 3}}
    with pytest.raises(ConfigError, match=r"a DFlash drafter's \(DFlashDraftModel\), not a target model's: were the "
                                          r"target and the drafter swapped\?"):
        TargetConfig.from_hf_config(drafter)
    target = {k: v for k, v in drafter.items() if k != "dflash_config"} | {"architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ConfigError, match=r"a LlamaForCausalLM model's, not a DFlash drafter's \(no dflash_config\): "
                                          r"were the target and the drafter swapped\?"):
        DrafterConfig.from_hf_config(target)
    assert TargetConfig.from_hf_config(target).num_hidden_layers == 1
    # a caller with one folder option names it (export's SRC, init-drafter's --target: no --drafter flag there)
    with pytest.raises(ConfigError, match=r"not a DFlash drafter's \(no dflash_config\): give a DFlash drafter's "
                                          r"folder as SRC$"):
        DrafterConfig.from_hf_config(target, flag="SRC")
    with pytest.raises(ConfigError, match=r"not a target model's: give the target model's folder as --target$"):
        TargetConfig.from_hf_config(drafter, flag="--target")


def test_fields_of_the_wrong_type_are_named():
    """A config.json field that is not an integer (a string, a fraction, a bool) is refused naming the field and
    what it holds, where int() once took "16" silently, truncated 16.5 and crashed on "abc"."""
    drafter = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": 10, "hidden_size": 8,
               "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "block_size": 16,
               "dflash_config": {"target_layer_ids": [1], "mask_token_id": 3}}
    assert DrafterConfig.from_hf_config(drafter).block_size == 16
    assert DrafterConfig.from_hf_config(dict(drafter, block_size=16.0)).block_size == 16  # integral: kept
    assert DrafterConfig.from_hf_config({k: v for k, v in drafter.items() if k != "block_size"}).block_size == 16
    for field, bad in (("block_size", "16"), ("block_size", 16.5), ("num_hidden_layers", True),
                       ("hidden_size", "abc"), ("max_position_embeddings", [4096])):
        with pytest.raises(ConfigError, match=rf"drafter config.json: '{field}' must be an integer, got "
                                              rf"{re.escape(repr(bad))}"):
            DrafterConfig.from_hf_config(dict(drafter, **{field: bad}))
    with pytest.raises(ConfigError, match=r"'dflash_config.mask_token_id' must be an integer, got '3'"):
        DrafterConfig.from_hf_config(dict(drafter, dflash_config={"target_layer_ids": [1], "mask_token_id": "3"}))
    with pytest.raises(ConfigError, match=r"'dflash_config.target_layer_ids' must be an integer, got 1.5"):
        DrafterConfig.from_hf_config(dict(drafter, dflash_config={"target_layer_ids": [1.5], "mask_token_id": 3}))
    with pytest.raises(ConfigError, match=r"target_layer_ids' must be a list of integers, got '1, 2'"):
        DrafterConfig.from_hf_config(dict(drafter, dflash_config={"target_layer_ids": "1, 2", "mask_token_id": 3}))
    target = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 2, "num_attention_heads": 2}
    assert TargetConfig.from_hf_config(dict(target, max_position_embeddings=None)).max_position_embeddings == 2048
    with pytest.raises(ConfigError, match=r"target config.json: 'vocab_size' must be an integer, got '10' \(str\)"):
        TargetConfig.from_hf_config(dict(target, vocab_size="10"))
    with pytest.raises(ConfigError, match="target config.json has no 'hidden_size'"):
        TargetConfig.from_hf_config(dict(target, hidden_size=None))



@pytest.mark.parametrize("change, words", [
    ({"dflash_config": "x"}, "'dflash_config' must be an object"),
    ({"rope_theta": None}, None),  # absent: the default 10000
    ({"rope_theta": "1e6"}, "'rope_theta' must be a number, got '1e6'"),
    ({"num_attention_heads": 0}, "'num_attention_heads' must be at least 1, got 0"),
    ({"head_dim": -64}, "'head_dim' must be at least 1, got -64"),
    ({"rope_scaling": "yarn"}, "'rope_scaling' must be an object"),
    ({"rope_scaling": {"rope_type": "linear"}}, "has no 'rope_scaling.factor'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "abc"}}, "'rope_scaling.factor' must be a number, got 'abc'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "has no 'rope_scaling.low_freq_factor'"),
    ({"layer_types": "full_attention"}, "'layer_types' must be a list of one string per layer"),
    ({"attention_bias": "no"}, "'attention_bias' must be true or false, got 'no' (str)"),
    ({"sliding_window": 0}, "'sliding_window' must be at least 1, got 0"),
    ({"rms_norm_eps": [1e-6]}, "'rms_norm_eps' must be a number"),
    ({"rms_norm_eps": float("nan")}, "'rms_norm_eps' must be a finite number > 0, got nan"),
    ({"rms_norm_eps": -1e-5}, "'rms_norm_eps' must be a finite number > 0, got -1e-05"),
    ({"rope_theta": 0}, "'rope_theta' must be a finite number > 0, got 0"),
    ({"rope_scaling": {"type": "linear", "factor": 0}}, "'rope_scaling.factor' must be a finite number > 0"),
    ({"rope_scaling": {"rope_type": "xyz"}}, "rope scaling type 'xyz' is not supported"),
    ({"layer_types": ["foo", "bar"]}, "'layer_types' has 2 entries for 1 layers"),
    ({"layer_types": ["foo"]}, "'layer_types' holds 'foo'; each must be one of full_attention, sliding_attention"),
    ({"draft_vocab_size": -5}, "'draft_vocab_size' must be at least 1, got -5"),
    ({"dflash_trt": "x"}, "'dflash_trt' (dflash-trt's own notes) must be an object"),
    ({"dflash_config": {"target_layer_ids": [1]}}, "has no dflash_config.mask_token_id"),
    ({"dflash_config": {"target_layer_ids": [], "mask_token_id": 3}}, "'dflash_config.target_layer_ids' is empty"),
    ({"block_size": 0}, "'block_size' must be at least 2, got 0"),
])
def test_drafter_fields_of_the_wrong_shape_are_named(tmp_path, change, words):
    """Each once crashed with a traceback (ZeroDivisionError, KeyError: 'factor', float(None), ...) or was
    misread ("no" as true, a string as its characters); from_pretrained names the file."""
    import json

    drafter = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": 10, "hidden_size": 8,
               "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
               "dflash_config": {"target_layer_ids": [1], "mask_token_id": 3}}
    (tmp_path / "config.json").write_text(json.dumps({**drafter, **change}))  # NaN as JSON's NaN
    if words is None:
        assert DrafterConfig.from_pretrained(tmp_path).rope_theta == 10000.0
        return
    with pytest.raises(ConfigError) as exc:
        DrafterConfig.from_pretrained(tmp_path)
    assert str(exc.value).startswith(str(tmp_path / "config.json")) and words in str(exc.value), str(exc.value)


def test_target_booleans_are_json_booleans():
    target = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 2, "num_attention_heads": 2}
    assert TargetConfig.from_hf_config(dict(target, tie_word_embeddings=True)).tie_word_embeddings is True
    with pytest.raises(ConfigError, match=r"target config.json: 'tie_word_embeddings' must be true or false, got "
                                          r"'false' \(str\)"):
        TargetConfig.from_hf_config(dict(target, tie_word_embeddings="false"))


def test_kv_heads_that_do_not_group_the_heads_are_named_with_the_file(tmp_path):
    target = {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 16,
              "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 5}
    (tmp_path / "config.json").write_text(json.dumps(target))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path / 'config.json'))}: 'num_attention_heads' 32 is "
                                          r"not a multiple of 'num_key_value_heads' 5 \(each KV head serves a whole "
                                          r"group of query heads\); fix it there$"):
        TargetConfig.from_pretrained(tmp_path)


def test_a_config_that_is_not_an_object_is_named(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config.json must hold one JSON object .*got list"):
        DrafterConfig.from_pretrained(tmp_path)
