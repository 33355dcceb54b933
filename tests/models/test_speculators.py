"""DFlash drafters in the vLLM `speculators` format: read, checked against the target, written, converted.

The real-model test writes the shipped drafter in the speculators format and decodes with it: the
tokens and every acceptance figure must equal the z-lab original's (the same network, read through
other field names and the `aux_hidden_state_layer_ids` = target_layer_ids + 1 indexing)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_main
from tests.training.conftest import MASK, TINY, word_tokenizer
from dflash_trt.config import DrafterConfig, TargetConfig
from dflash_trt.errors import CheckpointError, ConfigError, IncompatibleModelsError
from dflash_trt.models.checkpoints import init_drafter, load_drafter, load_target, new_drafter_config
from dflash_trt.models.loading import read_tensors, save_checkpoint
from dflash_trt.models.speculators import zlab_config
from dflash_trt.models.target import TargetModel
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.training.export import full_vocab_copy, speculators_copy


def _tiny_target(folder, seed):
    torch.manual_seed(seed)
    model = TargetModel(TargetConfig.from_hf_config(TINY))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    save_checkpoint(folder, TINY, model.state_dict())
    word_tokenizer().save_pretrained(folder)  # a runnable target: `check` refuses one without tokenizer files
    return folder


def _edit_tensors(folder, drop=(), **tensors):
    """Rewrite `folder`'s model.safetensors with `tensors` set (keys with dots: pass a dict via **{...}) and the
    keys of `drop` removed; its config.json is kept."""
    weights = {k: v for k, v in read_tensors(folder).items() if k not in drop}
    save_checkpoint(folder, json.loads((folder / "config.json").read_text()), {**weights, **tensors})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target folder, another target's folder, reduced-vocabulary z-lab drafter folder, its draft ids)."""
    root = tmp_path_factory.mktemp("spec")
    target, other = _tiny_target(root / "target", 0), _tiny_target(root / "other", 1)
    cfg = new_drafter_config(TargetConfig.from_hf_config(TINY), 2, 4, MASK, [0, 2]).replace(draft_vocab_size=24)
    drafter = init_drafter(cfg, root / "zlab", seed=0)
    ids = torch.arange(0, 48, 2)  # draft ids 0, 2, ..., 46
    _edit_tensors(drafter, d2t=ids - torch.arange(24))
    return target, other, drafter, ids


def test_speculators_copy_writes_the_format_and_loads_back(tmp_path, tiny):
    target, _, zlab, ids = tiny
    out = speculators_copy(zlab, tmp_path / "spec", target, verifier="org/tiny")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["aux_hidden_state_layer_ids"] == [1, 3]  # hidden_states indices: target_layer_ids + 1
    assert cfg["draft_vocab_size"] == 24 and cfg["transformer_layer_config"]["vocab_size"] == 64
    assert cfg["block_size"] == 4 and cfg["mask_token_id"] == MASK and not cfg["sample_from_anchor"]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": "org/tiny", "architectures": ["LlamaForCausalLM"]}
    assert "dflash_config" not in cfg and "dflash_config" not in cfg["transformer_layer_config"]
    tensors, original = read_tensors(out), read_tensors(zlab)
    head = read_tensors(target)["lm_head.weight"]
    assert torch.equal(tensors["lm_head.weight"], head[ids])  # the target's rows at the draft ids, in d2t order
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].nonzero().flatten().tolist() == ids.tolist()
    assert all(torch.equal(tensors[k], v) for k, v in original.items())
    assert cfg["num_target_layers"] == 4 and cfg["dflash_trt"] == {"untrained": True}  # extra fields of ours
    # read back: the same DrafterConfig and weights
    assert DrafterConfig.from_pretrained(out) == DrafterConfig.from_pretrained(zlab)
    loaded, again = load_drafter(out), load_drafter(zlab)
    assert set(loaded.target_copies.tensors) == {"lm_head.weight"}
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), again.state_dict().values()))
    DFlashProposer(loaded, load_target(target))  # the copy is this target's: accepted, then dropped
    assert loaded.target_copies is None


def test_zlab_copy_of_a_speculators_folder_equals_the_original_full_vocab_copy(tmp_path, tiny):
    target, _, zlab, _ = tiny
    spec = speculators_copy(zlab, tmp_path / "spec", target)
    a, b = full_vocab_copy(spec, tmp_path / "a"), full_vocab_copy(zlab, tmp_path / "b")
    ta, tb = read_tensors(a), read_tensors(b)
    assert set(ta) == set(tb) and "d2t" not in ta and all(torch.equal(ta[k], tb[k]) for k in ta)
    ca = json.loads((a / "config.json").read_text())
    assert ca["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [0, 2]} and "draft_vocab_size" not in ca
    assert DrafterConfig.from_pretrained(a) == DrafterConfig.from_pretrained(b)


def test_another_targets_lm_head_copy_is_refused(tmp_path, tiny):
    target, other, zlab, _ = tiny
    spec = speculators_copy(zlab, tmp_path / "spec", other)  # lm_head rows of another model
    with pytest.raises(IncompatibleModelsError, match="lm_head.weight.*trained with another target.*verifier"):
        DFlashProposer(load_drafter(spec), load_target(target))
    own = read_tensors(target)
    _edit_tensors(spec, **{"embed_tokens.weight": own["model.embed_tokens.weight"] * 1.5,
                           "lm_head.weight": own["lm_head.weight"][torch.arange(0, 48, 2)].bfloat16()})  # rounding only
    with pytest.raises(IncompatibleModelsError, match="'embed_tokens.weight' \\(the target's embedding"):
        DFlashProposer(load_drafter(spec), load_target(target))


def test_older_writers_extra_tensors_load_and_a_bad_t2d_is_refused(tmp_path, tiny):
    target, _, zlab, _ = tiny
    spec = speculators_copy(zlab, tmp_path / "spec", target)
    tensors = read_tensors(spec)
    _edit_tensors(spec, **{"embed_tokens.weight": read_tensors(target)["model.embed_tokens.weight"],
                           "verifier_lm_head.weight": tensors["lm_head.weight"].clone(),
                           "verifier_norm.weight": torch.ones(64)})
    drafter = load_drafter(spec)
    assert set(drafter.target_copies.tensors) == {"embed_tokens.weight", "lm_head.weight"}
    DFlashProposer(drafter, load_target(target))
    t2d = tensors["t2d"].clone()
    t2d[1] = True  # an id that d2t does not draft
    _edit_tensors(spec, t2d=t2d)
    with pytest.raises(CheckpointError, match="'t2d' does not mark the target ids 'd2t' gives"):
        load_drafter(spec)


def _spec_cfg(**changes):
    cfg = {"speculators_model_type": "dflash", "transformer_layer_config": {"model_type": "qwen3", "vocab_size": 64},
           "aux_hidden_state_layer_ids": [1, 3], "mask_token_id": 3, "block_size": 4, "draft_vocab_size": 64}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


@pytest.mark.parametrize("changes, message", [
    ({"speculators_model_type": "eagle3"}, "a speculators 'eagle3' drafter, not a DFlash one"),
    ({"transformer_layer_config": None}, "'transformer_layer_config' .* must be an object"),
    ({"aux_hidden_state_layer_ids": [0, 3]}, "'aux_hidden_state_layer_ids' must be a non-empty list of integers >= 1"),
    ({"aux_hidden_state_layer_ids": None}, "'aux_hidden_state_layer_ids' must be"),
    ({"mask_token_id": None}, "has no 'mask_token_id'"),
    ({"sample_from_anchor": True}, "'sample_from_anchor' is true"),
    ({"sliding_window_non_causal": True, "transformer_layer_config": {"layer_types": ["sliding_attention"]}},
     "'sliding_window_non_causal' is true"),
])
def test_speculators_config_errors_name_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        zlab_config(_spec_cfg(**changes), "x/config.json")


def test_speculators_config_maps_to_zlab():
    cfg = zlab_config(_spec_cfg(target_hidden_size=32))
    assert cfg["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [0, 2], "target_hidden_size": 32}
    assert "draft_vocab_size" not in cfg  # == vocab_size: the full vocabulary
    assert zlab_config(_spec_cfg(draft_vocab_size=24))["draft_vocab_size"] == 24


def test_export_cli_speculators_needs_the_target_for_a_reduced_vocabulary(tmp_path, tiny, capsys):
    from dflash_trt.training.export import main

    _, _, zlab, _ = tiny
    with pytest.raises(SystemExit) as exc:
        main([str(zlab), str(tmp_path / "out"), "--format", "speculators"])
    assert exc.value.code == 1 and "give the target with --target" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exc:
        main([str(zlab), str(tmp_path / "out"), "--verifier", "org/tiny"])
    assert exc.value.code == 2 and "--verifier is for --format speculators" in capsys.readouterr().err


def test_zlab_export_of_a_speculators_folder_checks_the_pair_with_target(tmp_path, tiny, capsys):
    """The z-lab copy drops a speculators drafter's copies of its target's weights: with --target they are
    checked first, so a drafter of another target is not turned into a z-lab drafter that hides it."""
    from dflash_trt.training.export import main

    target, other, zlab, _ = tiny
    spec = speculators_copy(zlab, tmp_path / "spec", target)
    with pytest.raises(SystemExit) as exc:
        main([str(spec), str(tmp_path / "out"), "--target", str(other)])
    assert exc.value.code == 1 and "'lm_head.weight' (the target's lm_head rows, stored by speculators) is not " \
        "this target's" in capsys.readouterr().err and not (tmp_path / "out").exists()
    main([str(spec), str(tmp_path / "out"), "--target", str(target)])
    out, err = capsys.readouterr()
    assert "wrote the full-vocabulary copy" in out and "note:" not in err
    main([str(spec), str(tmp_path / "unchecked")])  # no target to compare the copies with: said so
    assert "note: SRC's copies of its target's weights (lm_head.weight) were dropped unchecked" in capsys.readouterr().err
    main([str(zlab), str(tmp_path / "plain")])  # a z-lab SRC has no copies to drop
    assert "note:" not in capsys.readouterr().err
    assert DrafterConfig.from_pretrained(tmp_path / "out") == DrafterConfig.from_pretrained(zlab).replace(
        draft_vocab_size=None)


@pytest.mark.slow
def test_shipped_drafter_in_speculators_format_drafts_the_same(tmp_path, smollm2_path, smollm2_pipeline, monkeypatch,
                                                               capsys):
    """The shipped drafter written in the speculators format: `dflash-trt check` passes, and decoding gives
    the same tokens and the same acceptance per position as the z-lab original."""
    from dflash_trt.api import load_pipeline
    from dflash_trt.models.default import default_drafter_path
    from dflash_trt.runtime.sampling import SamplingParams

    spec = speculators_copy(default_drafter_path(), tmp_path / "spec", smollm2_path)
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(smollm2_path), "--drafter", str(spec))
    assert code == 0, out + err
    pipe = load_pipeline(str(smollm2_path), str(spec), dtype="float32", draft_confidence=0.0, tree_topk=1,
                         prompt_lookup=0, max_concurrency=None)
    prompts = [smollm2_pipeline.encode_chat(q) for q in ("Write a haiku about the sea.", "What is 12 times 7?")]
    prompts.append(smollm2_pipeline.encode("def fibonacci(n):\n    "))
    params = SamplingParams(max_tokens=40)
    ours, reference = pipe.generate(prompts, params), smollm2_pipeline.generate(prompts, params)
    for a, b in zip(ours, reference):
        assert a.token_ids == b.token_ids
        assert a.metrics.accepted_per_position == b.metrics.accepted_per_position
        assert a.metrics.verify_steps == b.metrics.verify_steps
    assert sum(r.metrics.accepted_tokens for r in ours) > 0


@pytest.mark.parametrize("changes, message", [
    ({"block_size": None}, "has no 'block_size'"),
    ({"draft_vocab_size": None}, "has no 'draft_vocab_size'"),
])
def test_speculators_config_needs_what_speculators_always_writes(changes, message):
    with pytest.raises(ConfigError, match=message):  # speculators' own defaults (8, 32000) are no guess for a file
        zlab_config(_spec_cfg(**changes))


def test_speculators_config_flags_read_as_speculators_reads_them():
    assert zlab_config(_spec_cfg(sample_from_anchor="false", sliding_window_non_causal="0"))
    with pytest.raises(ConfigError, match="'sample_from_anchor' is true"):
        zlab_config(_spec_cfg(sample_from_anchor="True"))


@pytest.mark.parametrize("speculators", [True, False], ids=["speculators", "zlab"])
@pytest.mark.parametrize("d2t, message", [
    (torch.arange(0, 48, 2).float() - torch.arange(24), "'d2t' is torch.float32 of shape \\[24\\]; it must hold int64"),
    (-torch.arange(24), "'d2t' gives some target id twice"),  # every draft id -> target id 0
    (torch.full((24,), 60, dtype=torch.int64), "'d2t' gives target ids outside \\[0, 63\\]"),
])
def test_malformed_d2t_is_an_error_naming_it(tmp_path, tiny, speculators, d2t, message):
    """In either format: no IndexError from indexing with it later, no draft id mapped twice."""
    from dflash_trt.compat import ERROR, check_checkpoints

    target, _, zlab, _ = tiny
    folder = speculators_copy(zlab, tmp_path / "d", target) if speculators else full_vocab_copy(zlab, tmp_path / "d")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["draft_vocab_size"] = 24  # the z-lab copy is the full-vocabulary one
    (folder / "config.json").write_text(json.dumps(cfg))
    _edit_tensors(folder, drop=("t2d",), d2t=d2t)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(folder)
    errors = [f.message for f in check_checkpoints(target, folder) if f.level == ERROR]
    assert len(errors) == 1 and message.replace("\\", "") in errors[0]


def test_check_compares_the_copies_with_the_target(tmp_path, tiny):
    """`dflash-trt check` finds what pairing refuses: another target's lm_head rows, an inconsistent copy."""
    from dflash_trt.compat import ERROR, check_checkpoints

    target, other, zlab, _ = tiny
    spec = speculators_copy(zlab, tmp_path / "spec", target, verifier="org/tiny")
    assert [f for f in check_checkpoints(target, spec) if f.level == ERROR] == []
    errors = [f.message for f in check_checkpoints(other, spec) if f.level == ERROR]
    assert len(errors) == 1 and "'lm_head.weight' (the target's lm_head rows, stored by speculators) is not this " \
        "target's: the drafter was trained with another target ('org/tiny', its speculators_config.verifier)" in errors[0]
    _edit_tensors(spec, **{"lm_head.weight": read_tensors(spec)["lm_head.weight"][:20]})
    errors = [f.message for f in check_checkpoints(target, spec) if f.level == ERROR]
    assert len(errors) == 1 and "'lm_head.weight' (its copy of the target's lm_head rows) has shape [20, 64], its " \
        "vocabulary and hidden size imply [24, 64]; the checkpoint is inconsistent" in errors[0]
    with pytest.raises(CheckpointError, match="the checkpoint is inconsistent"):
        DFlashProposer(load_drafter(spec), load_target(target))


def test_export_checks_the_pair_and_names_the_verifier(tmp_path, tiny):
    target, other, zlab, _ = tiny
    spec = speculators_copy(zlab, tmp_path / "spec", target)
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(target.resolve())
    with pytest.raises(IncompatibleModelsError, match="is not this target's"):  # its copy says it is target's
        speculators_copy(spec, tmp_path / "again", other)
    assert not (tmp_path / "again").exists()
    full = full_vocab_copy(zlab, tmp_path / "full")
    out = speculators_copy(full, tmp_path / "nameless")  # full vocabulary: no target needed, none named
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] is None
    cfg = json.loads((full / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 9]
    (full / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(IncompatibleModelsError, match="target_layer_ids \\[0, 9\\]: \\[9\\] outside \\[0, 3\\]"):
        speculators_copy(full, tmp_path / "x", target)


def test_layer_id_and_mask_messages_use_the_speculators_fields(tmp_path, tiny):
    from dflash_trt.compat import compatibility_problems

    target = TargetConfig.from_pretrained(tiny[0])
    drafter = DrafterConfig.from_hf_config(zlab_config(_spec_cfg(
        aux_hidden_state_layer_ids=[1, 5], mask_token_id=TINY["vocab_size"],
        transformer_layer_config={**TINY, "model_type": "qwen3", "num_hidden_layers": 1})))
    assert drafter.checkpoint_format == "speculators"
    problems = compatibility_problems(target, drafter)
    assert any(p.startswith("aux_hidden_state_layer_ids [1, 5]: [5] outside [1, 4] (hidden_states indices of a "
                            "target with 4 layers)") for p in problems)
    mask = [p for p in problems if p.startswith("mask_token_id")]
    assert len(mask) == 1 and mask[0].endswith("set mask_token_id to a reserved token id of the target's tokenizer")
    zlab = DrafterConfig.from_pretrained(tiny[2]).replace(mask_token_id=TINY["vocab_size"])
    mask = [p for p in compatibility_problems(target, zlab) if p.startswith("mask_token_id")]
    assert len(mask) == 1 and "set dflash_config.mask_token_id to a reserved" in mask[0]


def test_force_replaces_a_speculators_folder_whatever_its_architectures(tmp_path, tiny):
    target, _, zlab, _ = tiny
    spec = speculators_copy(zlab, tmp_path / "spec", target)
    cfg = json.loads((spec / "config.json").read_text())
    cfg["architectures"] = ["DFlashSpeculator"]  # speculators' own default
    (spec / "config.json").write_text(json.dumps(cfg))
    assert load_drafter(spec).config == DrafterConfig.from_pretrained(zlab)
    speculators_copy(zlab, spec, target, force=True)
    assert json.loads((spec / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


def test_a_corrupt_copy_of_the_targets_weights_is_refused_by_check_and_loading(tmp_path, tiny):
    """A NaN in speculators' lm_head copy: its distance to the target's rows is NaN, which used to pass the
    closeness test (NaN > tolerance is false); loading and check refuse it as corrupt."""
    from dflash_trt.compat import ERROR, check_checkpoints

    target, _, zlab, _ = tiny
    spec = speculators_copy(zlab, tmp_path / "spec", target)
    head = read_tensors(spec)["lm_head.weight"].clone()
    head[0, 0] = float("nan")
    _edit_tensors(spec, **{"lm_head.weight": head})
    errors = [f.message for f in check_checkpoints(target, spec) if f.level == ERROR]
    assert any("'lm_head.weight' holds NaN or infinite values" in e for e in errors), errors
    with pytest.raises(CheckpointError, match="'lm_head.weight' holds NaN or infinite values"):
        load_drafter(spec)
    with pytest.raises(IncompatibleModelsError, match="is not this target's"):  # the closeness test alone
        from dflash_trt.models.speculators import TargetCopies

        want = read_tensors(target)["model.embed_tokens.weight"]
        TargetCopies({"embed_tokens.weight": torch.full_like(want, float("nan"))}, str(spec)).check(want, want, None)
