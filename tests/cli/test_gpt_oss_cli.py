"""A gpt-oss target through the product: `dflash-trt init-drafter`, `check`, `generate`, `serve` (real HTTP, the real
`openai` client), `train-drafter` (its default --init target) and `build` (refused, naming what runs it)."""

from __future__ import annotations


import pytest
import torch

from tests.cli.family_cli_checks import (check_generate_dflash_equals_ar, check_serve_answers_greedy,
                                         check_train_drafter_from_a_moe_target)
from tests.conftest import run_main
from tests.models.gpt_oss_helpers import make_gpt_oss_model, write_mxfp4_copy


@pytest.fixture(scope="module")
def gpt_oss_pair(tmp_path_factory, smollm2_path):
    """(target, drafter): a tiny gpt-oss target with SmolLM2's tokenizer, stored in MXFP4 as openai/gpt-oss-20b
    is, and the drafter `dflash-trt init-drafter` writes for it."""
    from click.testing import CliRunner

    from dflash_trt.cli import cli

    root = tmp_path_factory.mktemp("gpt-oss-cli")
    _, plain = make_gpt_oss_model(root / "plain", tokenizer_from=smollm2_path, vocab_size=49152)
    target = write_mxfp4_copy(plain, root / "target")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((plain / name).read_bytes())
    res = CliRunner().invoke(cli, ["init-drafter", "--target", str(target), "--out", str(root / "drafter"),
                                   "--num-layers", "1", "--block-size", "4", "--target-layer-ids", "1,2",
                                   "--mask-token-id", "16"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return target, root / "drafter"


def test_check_accepts_an_mxfp4_gpt_oss_target(monkeypatch, capsys, gpt_oss_pair):
    target, drafter = gpt_oss_pair
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(target), "--drafter", str(drafter))
    assert code == 0, err
    assert out.startswith("ok: the drafter fits the target (1 warning)") and "untrained" in err


def test_generate_dflash_gives_the_autoregressive_tokens(monkeypatch, capsys, gpt_oss_pair):
    check_generate_dflash_equals_ar(monkeypatch, capsys, gpt_oss_pair)


def test_serve_answers_with_the_targets_greedy_tokens(gpt_oss_pair):
    check_serve_answers_greedy(gpt_oss_pair)


def test_train_drafter_with_init_target_copies_the_attention(tmp_path, gpt_oss_pair):
    """--init target (the default): each drafter layer takes its source layer's attention weights and norms (not
    its biases or sinks: the drafter has none); the experts have no dense copy, so its MLP starts with a zero
    down_proj."""
    from dflash_trt.models.checkpoints import load_drafter, load_target
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.training.init import init_from_target

    target, drafter_folder = gpt_oss_pair
    model = load_target(target)
    drafter = DFlashDrafter(load_drafter(drafter_folder).config)
    assert init_from_target(drafter, model) == [3]
    layer, source = drafter.layers[0], model.model.layers[3]
    assert torch.equal(layer.self_attn.o_proj.weight, source.self_attn.o_proj.weight)
    assert torch.equal(layer.input_layernorm.weight, source.input_layernorm.weight)
    assert not layer.mlp.down_proj.weight.any() and layer.mlp.gate_proj.weight.any()
    check_train_drafter_from_a_moe_target(gpt_oss_pair, tmp_path)


def test_build_refuses_a_gpt_oss_target_naming_what_runs_it(monkeypatch, capsys, gpt_oss_pair, tmp_path):
    target, drafter = gpt_oss_pair
    code, out, err = run_main(monkeypatch, capsys, "build", "--target", str(target), "--drafter", str(drafter),
                              "--out", str(tmp_path / "bundle"))
    assert code != 0
    assert f"dflash-trt build does not take a gpt_oss target ({target})" in err
    assert "dflash-trt generate / serve / bench" in err and err.count("\n") <= 2, err
    assert not (tmp_path / "bundle").exists()
