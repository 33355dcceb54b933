"""Strict checkpoint loading: every key used, every shape checked, errors name key and shape."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.config import DrafterConfig, TargetConfig
from dflash_trt.errors import CheckpointError
from dflash_trt.models.checkpoints import init_drafter, load_drafter, load_target, new_drafter_config
from tests.conftest import make_hf_model


@pytest.fixture
def target_folder(tmp_path):
    return make_hf_model(tmp_path, "llama")[1]


@pytest.fixture
def drafter_folder(tmp_path, target_folder):
    cfg = new_drafter_config(TargetConfig.from_pretrained(target_folder), 2, 4, 95, [0, 2])
    return init_drafter(cfg, tmp_path / "drafter")


def edit_weights(folder, fn):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def test_missing_key_names_key_and_shape(target_folder):
    edit_weights(target_folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing key\(s\) model\.layers\.1\.mlp\.up_proj\.weight \[128, 64\]"):
        load_target(target_folder)


def test_unexpected_key(target_folder):
    edit_weights(target_folder, lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected key\(s\) model\.layers\.9\.extra\.weight"):
        load_target(target_folder)


@pytest.mark.parametrize("auto", ["AutoModel", "AutoModelForSequenceClassification"])
def test_a_target_that_is_no_causal_lm_is_named_so(tmp_path, auto):
    """A Llama saved as a base model (LlamaModel: keys without "model.", no lm_head) or a classifier fails to load
    naming its architectures and the fix; "does not match its config.json" alone sent users to re-download it."""
    import transformers

    from tests.conftest import tiny_hf_config

    folder = tmp_path / auto
    getattr(transformers, auto).from_config(tiny_hf_config("llama")).save_pretrained(folder)
    arch = json.loads((folder / "config.json").read_text())["architectures"]
    assert arch == [{"AutoModel": "LlamaModel", "AutoModelForSequenceClassification": "LlamaForSequenceClassification"}[auto]]
    with pytest.raises(CheckpointError) as exc:
        load_target(folder)
    assert str(exc.value).endswith(
        f"; the checkpoint does not match its config.json. Its config.json names architectures {arch}, not a causal "
        "language model (...ForCausalLM, e.g. LlamaForCausalLM): give the folder of the causal-LM checkpoint, the one "
        "generating text with its lm_head"), str(exc.value)


def test_wrong_shape(drafter_folder):
    edit_weights(drafter_folder, lambda t: t.update({"layers.0.self_attn.k_norm.weight": torch.ones(8)}))
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.k_norm\.weight has shape \[8\], expected \[16\]"):
        load_drafter(drafter_folder)


def test_wrong_fc_width(drafter_folder):
    # the config says 2 target layers (fc in = 128) but the weights were made for 3 (192)
    edit_weights(drafter_folder, lambda t: t.update({"fc.weight": torch.zeros(64, 192)}))
    with pytest.raises(CheckpointError, match=r"fc\.weight has shape \[64, 192\], expected \[64, 128\]"):
        load_drafter(drafter_folder)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="no such folder"):
        load_target(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_target(tmp_path / "empty")


def test_sharded_index_loads_same_weights(tmp_path, target_folder):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_folder)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB", safe_serialization=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = load_target(target_folder), load_target(sharded)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_a_missing_shard_or_damaged_index_names_the_fix_as_check_does(tmp_path, target_folder):
    """Loading a sharded target with a shard gone (or an index that is not JSON) gives `dflash-trt check`'s
    message, fix included (`safetensors_files` is what both read)."""
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(target_folder).save_pretrained(sharded, max_shard_size="100KB")
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError) as e:
        load_target(sharded)
    assert str(e.value) == (f"{sharded}: index names shard(s) that are missing: {shard.name}; download every shard "
                            "model.safetensors.index.json names (or re-save the checkpoint)")
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: not a readable index \(.*\); re-save or "
                                              r"re-download it$"):
        load_target(sharded)


def test_drafter_config_roundtrip(drafter_folder):
    raw = json.loads((drafter_folder / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [0, 2]}
    assert raw["dflash_trt"] == {"untrained": True}
    cfg = DrafterConfig.from_pretrained(drafter_folder)
    assert DrafterConfig.from_hf_config(cfg.to_hf_dict()) == cfg
    assert not cfg.trained and cfg.block_size == 4 and cfg.fc_in_features == 128
