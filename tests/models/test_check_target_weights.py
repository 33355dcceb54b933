"""`check_checkpoints` reads the target's weights too (safetensors headers and the index only, no tensor
data): a target with no weights, a truncated file, a missing shard, a damaged index, missing keys or
tensors of another shape than config.json implies are one-line errors naming the fix; the GGUF-converted
default target, a sharded target, a tied lm_head and ModelOpt FP8 / NVFP4 layouts pass."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.compat import ERROR, check_checkpoints
from tests.conftest import make_hf_model
from tests.training.conftest import word_tokenizer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target folder, drafter folder): tiny random Llama (hidden 64, 4 layers, vocab 96) with a word-level
    tokenizer, 1-layer drafter."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter, new_drafter_config

    root = tmp_path_factory.mktemp("pair")
    _, target = make_hf_model(root)
    word_tokenizer(96).save_pretrained(target)  # a runnable target: `check` refuses one without tokenizer files
    cfg = new_drafter_config(TargetConfig.from_pretrained(target), 1, 4, 95, [1, 2])
    return target, init_drafter(cfg, root / "drafter", seed=0)


@pytest.fixture
def target(tmp_path, pair):
    """A copy of the pair's target to damage."""
    return shutil.copytree(pair[0], tmp_path / "target")


def errors(target, drafter) -> list[str]:
    found = [f.message for f in check_checkpoints(target, drafter) if f.level == ERROR]
    assert all("\n" not in e for e in found), found  # one line each
    return found


def test_the_tiny_pair_and_the_default_gguf_target_pass(pair, smollm2_path):
    from dflash_trt.models.default import default_drafter_path

    assert errors(*pair) == []
    assert errors(smollm2_path, default_drafter_path()) == []  # converted from GGUF; tied lm_head absent


def test_a_target_without_weights(target, pair):
    (target / "model.safetensors").unlink()
    assert errors(target, pair[1]) == [f"target: {target}: no *.safetensors weights found; save the model with "
                                       "`save_pretrained(..., safe_serialization=True)`"]


def test_a_truncated_target(target, pair):
    weights = target / "model.safetensors"
    for size in (weights.stat().st_size - 100, 1000, 5):
        weights.write_bytes((pair[0] / "model.safetensors").read_bytes()[:size])
        [err] = errors(target, pair[1])
        assert err.startswith(f"target: {weights}: not a readable safetensors file (") and err.endswith(
            "); re-save or re-download it"), err


def test_sharded_targets_and_a_missing_shard(tmp_path, pair):
    from transformers import AutoModelForCausalLM

    target = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(pair[0]).save_pretrained(target, max_shard_size="100KB")
    word_tokenizer(96).save_pretrained(target)
    shards = sorted(target.glob("model-*.safetensors"))
    assert (target / "model.safetensors.index.json").is_file() and len(shards) > 2
    assert errors(target, pair[1]) == []
    shards[1].unlink()
    assert errors(target, pair[1]) == [
        f"target: {target}: index names shard(s) that are missing: {shards[1].name}; download every shard "
        "model.safetensors.index.json names (or re-save the checkpoint)"]
    (target / "model.safetensors.index.json").write_text('{"weight_map": ')
    [err] = errors(target, pair[1])
    assert err.startswith(f"target: {target / 'model.safetensors.index.json'}: not a readable index (")
    assert err.endswith("); re-save or re-download it")


def test_missing_and_unexpected_target_keys(target, pair):
    tensors = load_file(str(target / "model.safetensors"))
    embed = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(target / "model.safetensors"))
    assert errors(target, pair[1]) == [f"target weights: model.embed_tokens.weight [96, 64] is missing from {target}; "
                                       "the weights do not match config.json (re-download or re-convert the target)"]
    save_file({**tensors, "model.embed_tokens.weight": embed, "model.extra.weight": torch.zeros(2)},
              str(target / "model.safetensors"))
    [err] = errors(target, pair[1])
    assert err.startswith(f"target weights: unexpected key(s) model.extra.weight in {target}; "), err


def test_a_config_that_does_not_describe_the_target_weights(target, pair):
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 256}))
    assert errors(target, pair[1]) == [
        "target weights: model.layers.0.mlp.gate_proj.weight has shape [128, 64], config.json implies [256, 64] "
        "(and 11 more tensors of another shape); config.json (vocab_size, hidden_size, intermediate_size, heads) "
        "does not describe these weights: use the config.json that came with them, or the matching checkpoint"]
    (target / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 6}))
    found = errors(target, pair[1])
    assert found[0].startswith("target weights: model.layers.4.self_attn.q_proj.weight [64, 64], "), found
    assert " (and 13 more) are missing from " in found[0]
    assert any("num_target_layers" in e for e in found[1:])  # the drafter was made for 4 layers


def test_tied_lm_head_may_be_there_or_not(target, pair):
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    assert errors(target, pair[1]) == []  # lm_head.weight stored although tied: load_target ignores it
    tensors = load_file(str(target / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(target / "model.safetensors"))
    assert errors(target, pair[1]) == []
    (target / "config.json").write_text(json.dumps(cfg))  # untied: the lm_head is needed
    assert errors(target, pair[1]) == [f"target weights: lm_head.weight [96, 64] is missing from {target}; the weights "
                                       "do not match config.json (re-download or re-convert the target)"]


def test_modelopt_fp8_and_nvfp4_layouts_pass(target, pair):
    """FP8: float8 weight of the same shape + scales; NVFP4: uint8 [out, in / 2] + block and global scales
    (the layouts of `dflash_trt.models.dequant`); only the headers are read."""
    tensors = load_file(str(target / "model.safetensors"))
    fp8, nvfp4 = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"
    tensors[f"{fp8}.weight"] = tensors[f"{fp8}.weight"].to(torch.float8_e4m3fn)
    tensors[f"{fp8}.weight_scale"], tensors[f"{fp8}.input_scale"] = torch.ones(()), torch.ones(())
    out, cols = tensors[f"{nvfp4}.weight"].shape
    tensors[f"{nvfp4}.weight"] = torch.zeros(out, cols // 2, dtype=torch.uint8)
    tensors[f"{nvfp4}.weight_scale"] = torch.ones(out, cols // 16).to(torch.float8_e4m3fn)
    tensors[f"{nvfp4}.weight_scale_2"] = torch.ones(())
    save_file(tensors, str(target / "model.safetensors"))
    assert "unexpected key(s)" in errors(target, pair[1])[0]  # scales, but config.json says nothing is quantized
    cfg = json.loads((target / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}
    (target / "config.json").write_text(json.dumps(cfg))
    assert errors(target, pair[1]) == []
    tensors[f"{nvfp4}.weight"] = torch.zeros(out, cols // 4, dtype=torch.uint8)  # another width
    save_file(tensors, str(target / "model.safetensors"))
    assert errors(target, pair[1]) == [
        f"target weights: {nvfp4}.weight has shape [{out}, {cols // 4}], config.json implies [{out}, {cols // 2}]; "
        "config.json (vocab_size, hidden_size, intermediate_size, heads) does not describe these weights: use the "
        "config.json that came with them, or the matching checkpoint"]


def test_no_target_tensor_data_is_read(target, pair, monkeypatch):
    """The target's headers only: a check that read its tensors would cost a big target's load time. The
    drafter's values are read (a drafter is small next to its target): weights holding NaN / inf are an error."""
    from safetensors import safe_open

    opened = []

    class Spy:
        def __init__(self, f, path):
            self.f, self.drafter = f, str(path).startswith(str(pair[1]))

        def __enter__(self):
            opened.append(self)
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            return self.f.get_slice(key)

        def get_tensor(self, key):
            if not self.drafter:
                raise AssertionError(f"target tensor data read: {key}")
            return self.f.get_tensor(key)

    import dflash_trt.models.loading as loading

    monkeypatch.setattr(loading, "safe_open", lambda *a, **k: Spy(safe_open(*a, **k).__enter__(), a[0]))
    assert errors(target, pair[1]) == []
    assert sorted(s.drafter for s in opened) == [False, True, True]  # the target's header; the drafter's, its values


def test_kv_cache_scales_pass_only_with_an_fp8_kv_cache_config(target, pair):
    """check agrees with the loader (`checkpoints._read_weights`): k_scale / v_scale in an unquantized
    target are unexpected unless its config says the KV cache is FP8, as ModelOpt writes it."""
    tensors = load_file(target / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
    tensors["model.layers.0.self_attn.v_proj.v_scale"] = torch.tensor(1.0)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    [err] = errors(target, pair[1])
    assert "unexpected key(s) model.layers.0.self_attn.k_proj.k_scale, model.layers.0.self_attn.v_proj.v_scale" in err
    cfg = json.loads((target / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "kv_cache_scheme": {"type": "float", "num_bits": 8}}
    (target / "config.json").write_text(json.dumps(cfg))
    assert errors(target, pair[1]) == []
    tensors["model.layers.0.self_attn.k_proj.weight_scale"] = torch.tensor(1.0)  # not a KV-cache scale
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    [err] = errors(target, pair[1])
    assert "unexpected key(s) model.layers.0.self_attn.k_proj.weight_scale" in err
