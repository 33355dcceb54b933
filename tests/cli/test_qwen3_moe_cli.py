"""A Qwen3-MoE target through the product: `dflash-trt init-drafter`, `check`, `generate`, `serve` (real HTTP, the
real `openai` client) and `train-drafter` (its default --init target copying the target's layers)."""

from __future__ import annotations


import pytest
import torch

from tests.cli.family_cli_checks import (check_generate_dflash_equals_ar, check_serve_answers_greedy,
                                         check_train_drafter_from_a_moe_target)
from tests.conftest import run_main
from tests.models.qwen3_moe_helpers import make_moe_model


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory, smollm2_path):
    """(target, drafter): a tiny Qwen3-MoE target with SmolLM2's tokenizer, and the drafter `dflash-trt
    init-drafter` writes for it."""
    from click.testing import CliRunner

    from dflash_trt.cli import cli

    root = tmp_path_factory.mktemp("moe-cli")
    _, target = make_moe_model(root / "target", tokenizer_from=smollm2_path, vocab_size=49152)
    res = CliRunner().invoke(cli, ["init-drafter", "--target", str(target), "--out", str(root / "drafter"),
                                   "--num-layers", "1", "--block-size", "4", "--target-layer-ids", "1,2",
                                   "--mask-token-id", "16"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return target, root / "drafter"


def test_check_accepts_a_moe_target_and_names_a_missing_expert(monkeypatch, capsys, moe_pair, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    target, drafter = moe_pair
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(target), "--drafter", str(drafter))
    assert code == 0, err
    assert out.startswith("ok: the drafter fits the target (1 warning)") and "untrained" in err
    broken = tmp_path / "broken"
    shutil.copytree(target, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.3.mlp.experts.5.gate_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(broken), "--drafter", str(drafter))
    assert code == 1
    assert "error: target weights: model.layers.3.mlp.experts.5.gate_proj.weight [32, 64] is missing from" in err


def test_generate_dflash_gives_the_autoregressive_tokens(monkeypatch, capsys, moe_pair):
    check_generate_dflash_equals_ar(monkeypatch, capsys, moe_pair)


def test_serve_answers_with_the_targets_greedy_tokens(moe_pair):
    check_serve_answers_greedy(moe_pair)


def test_train_drafter_with_init_target_copies_the_attention_of_sparse_layers(tmp_path, moe_pair):
    """--init target (the default) on a MoE target: each drafter layer takes its source layer's attention and norms;
    the experts have no dense copy, so the drafter's MLP starts with a zero down_proj."""
    from dflash_trt.models.checkpoints import load_drafter, load_target
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.training.init import init_from_target

    target, _ = moe_pair
    model = load_target(target)
    drafter = DFlashDrafter(load_drafter(moe_pair[1]).config)
    assert init_from_target(drafter, model) == [3]  # the top layer, a sparse one
    layer, source = drafter.layers[0], model.model.layers[3]
    assert torch.equal(layer.self_attn.q_proj.weight, source.self_attn.q_proj.weight)
    assert torch.equal(layer.post_attention_layernorm.weight, source.post_attention_layernorm.weight)
    assert not layer.mlp.down_proj.weight.any() and layer.mlp.gate_proj.weight.any()
    check_train_drafter_from_a_moe_target(moe_pair, tmp_path)
