"""Export: a reduced-vocabulary drafter carries its d2t map, loads strictly and drafts losslessly;
the full-vocabulary copy is plain z-lab format."""

import json

import torch

from tests.training.conftest import DATA_LAYERS, EOS, MASK
from dflash_trt.models.checkpoints import load_drafter, new_drafter_config
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.loading import read_tensors
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.training.export import export_drafter, full_vocab_copy
from dflash_trt.training.pipeline import make_train_data
from dflash_trt.training.trainer import TrainConfig, train
from dflash_trt.training.vocab import d2t_offsets, draft_to_target, top_tokens


def test_reduced_vocab_export_loads_and_drafts(tmp_path, tiny_target, tiny_samples, tiny_prompts):
    ids = top_tokens(tiny_samples, 24, 64, (EOS,))
    assert ids.numel() == 24 and EOS in ids.tolist() and torch.equal(ids, ids.sort().values)
    assert torch.equal(draft_to_target(d2t_offsets(ids)), ids)
    cfg = new_drafter_config(tiny_target.config, 1, 4, MASK, [0, 1]).replace(draft_vocab_size=24)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    drafter.d2t.copy_(d2t_offsets(ids))
    data = make_train_data(tiny_samples, DATA_LAYERS, (0, 1), tiny_target, ids)
    tc = TrainConfig(block_size=4, anchors_per_seq=8, epochs=6, lr=1e-2, checkpoint_every=1000, log_every=5)
    state = train(drafter, data, tc, tmp_path / "run", progress=False)
    out = export_drafter(drafter, tmp_path / "drafter", {"steps": state.step}, state.history, torch.bfloat16)
    hf = json.loads((out / "config.json").read_text())
    assert hf["draft_vocab_size"] == 24 and hf["architectures"] == ["DFlashDraftModel"]
    tensors = read_tensors(out)
    assert tensors["d2t"].dtype == torch.int64 and tensors["fc.weight"].dtype == torch.bfloat16
    loaded = load_drafter(out)
    assert torch.equal(loaded.draft_token_ids(), ids)
    proposer = DFlashProposer(loaded, tiny_target)
    engine = Engine(tiny_target, proposer, (EOS,))
    params = SamplingParams(max_tokens=30)
    res = engine.generate(tiny_prompts[:6], params, mode="dflash")
    ar = Engine(tiny_target, None, (EOS,)).generate(tiny_prompts[:6], params, mode="ar")
    assert [r.token_ids for r in res] == [r.token_ids for r in ar]
    assert sum(r.metrics.accepted_tokens for r in res) > 0
    # drafts are target ids of the draft vocabulary only
    proposer.reset(2, 16)
    drafts = proposer.propose(torch.tensor([5, 6]), torch.tensor([0, 0]), 0, None, [params] * 2, [None] * 2)
    assert set(drafts.tokens.flatten().tolist()) <= set(ids.tolist())
    # sampled drafts: q is a distribution over the full vocabulary, zero off the draft vocabulary
    sp = SamplingParams(temperature=1.0, max_tokens=30, seed=0)
    proposer.reset(1, 16)
    drafts = proposer.propose(torch.tensor([5]), torch.tensor([0]), 0, torch.tensor([0]), [sp],
                              [torch.Generator().manual_seed(0)])
    q = drafts.probs[0]
    assert q.shape == (3, 64) and torch.allclose(q.sum(-1), torch.ones(3))
    off = torch.ones(64, dtype=torch.bool)
    off[ids] = False
    assert q[:, off].abs().max() == 0

    (out / "acceptance.md").write_text("tau of the reduced-vocabulary drafts")
    full = full_vocab_copy(out, tmp_path / "full")
    assert not (full / "acceptance.md").exists()  # measured on the other variant: not copied
    assert "draft_vocab_size" not in json.loads((full / "config.json").read_text())
    assert "d2t" not in read_tensors(full)
    full_drafter = load_drafter(full)
    assert full_drafter.d2t is None
    assert torch.equal(full_drafter.state_dict()["fc.weight"], loaded.state_dict()["fc.weight"])
    assert (full / "training.json").is_file() and (full / "loss.png").is_file()


def test_readme_names_the_exported_step():
    from dflash_trt.config import DrafterConfig
    from dflash_trt.training.export import bundle_readme

    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=100, block_size=4, mask_token_id=3,
                        target_layer_ids=(0,), num_target_layers=2, target_hidden_size=64)
    info = {"steps": 30, "exported_step": 30, "data": {"samples": 8}}
    assert "The weights are those of step" not in bundle_readme(cfg, info)  # the last step: nothing to say
    val = {"samples": 4, "best_acceptance_length": 1.25}
    mid = bundle_readme(cfg, {**info, "exported_step": 20, "validation": val})
    assert "The weights are those of step 20 of 30, the best held-out tau (1.250) (`--keep-best`)." in mid
    start = bundle_readme(cfg, {**info, "exported_step": 0, "validation": val})
    assert "step 0 of 30, the best held-out tau (1.250) (`--keep-best`): the weights training started from (`--init`)" in start


def test_the_packaged_readme_is_bundle_readme_and_says_an_existing_out_needs_force():
    """The packaged drafter's README.md is what `bundle_readme` writes for it (so the two never drift); its
    export command says that an existing OUT_FOLDER needs --force and a file is never replaced."""
    import json

    from dflash_trt.config import DrafterConfig
    from dflash_trt.models.default import default_drafter_path
    from dflash_trt.training.export import bundle_readme

    folder = default_drafter_path()
    text = (folder / "README.md").read_text()
    assert text == bundle_readme(DrafterConfig.from_pretrained(folder), json.loads((folder / "training.json").read_text()))
    assert ("`python -m dflash_trt.training.export THIS_FOLDER OUT_FOLDER` (an existing OUT_FOLDER needs `--force`; a "
            "file there is never replaced).") in text


# `python -m dflash_trt.training.export SRC DST [--force]`: refuses what would lose data, one-line errors


def _reduced_drafter(folder):
    """A random tiny reduced-vocabulary drafter exported to `folder`, with an acceptance.md beside it."""
    from tests.training.conftest import TINY

    from dflash_trt.config import TargetConfig

    torch.manual_seed(0)
    cfg = new_drafter_config(TargetConfig.from_hf_config(TINY), 1, 4, MASK, [0, 1]).replace(draft_vocab_size=24)
    out = export_drafter(DFlashDrafter(cfg), folder, {"steps": 1}, [])
    (out / "acceptance.md").write_text("tau of the reduced-vocabulary drafts")
    return out


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _export_cli(capsys, *args):
    """(exit code, stdout, stderr) of the export command line run in-process."""
    import pytest

    from dflash_trt.training.export import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
        raise SystemExit(0)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_export_cli_keeps_a_file_at_dst_even_with_force(tmp_path, capsys):
    src = _reduced_drafter(tmp_path / "drafter")
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"my notes\x00\n")
    for extra in ((), ("--force",)):
        code, out, err = _export_cli(capsys, src, notes, *extra)
        # without --force too: it said "already exists; ... pass --force", which then refused the file
        want = (f"error: DST {notes} is a file, not a DFlash drafter folder; --force replaces only a DFlash drafter "
                "folder or an empty folder")
        assert code == 1 and out == "" and err.count("\n") == 1 and err.startswith(want), err
        assert notes.read_bytes() == b"my notes\x00\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "notes.txt"]  # no temporary folder left


def test_export_cli_replaces_an_existing_folder_only_with_force(tmp_path, capsys):
    """An existing DST needs --force, which replaces a drafter folder (here an earlier copy) but never a
    folder of other files (tests/training/test_out_folder.py has the rest of that rule)."""
    src = _reduced_drafter(tmp_path / "drafter")
    dst = tmp_path / "full"
    dst.mkdir()
    (dst / "keep.txt").write_text("old")
    for extra in ((), ("--force",)):
        code, out, err = _export_cli(capsys, src, dst, *extra)
        assert code == 1 and out == "" and err.count("\n") == 1
        assert err.startswith(f"error: DST {dst} already exists;" if not extra else
                              f"error: DST {dst} is a folder that is not a DFlash drafter folder") and "--force" in err
        assert _snapshot(dst) == {"keep.txt": b"old"}
    (dst / "keep.txt").unlink()
    code, out, err = _export_cli(capsys, src, dst)  # an empty folder: written over as a new one would be
    assert code == 1 and err.startswith(f"error: DST {dst} already exists, an empty folder; pass --force to write into "
                                        "it (nothing is there to lose)")
    assert _export_cli(capsys, src, dst, "--force")[0] == 0
    (dst / "acceptance.md").write_text("measured on the copy")  # what evaluate writes there: replaced too
    code, out, err = _export_cli(capsys, src, dst, "--force")
    assert code == 0 and err == "" and out == f"wrote the full-vocabulary copy of {src} to {dst}\n"
    assert not (dst / "acceptance.md").exists()
    assert "d2t" not in read_tensors(dst) and load_drafter(dst).d2t is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "full"]


def test_export_cli_refuses_dst_overlapping_src_even_with_force(tmp_path, capsys, monkeypatch):
    src = _reduced_drafter(tmp_path / "drafter")
    before = _snapshot(src)
    monkeypatch.chdir(tmp_path)
    for dst, where in ((src, "is"), (tmp_path / "drafter" / ".." / "drafter", "is"), (src / "full", "is inside"),
                       (tmp_path, "holds"), ("drafter", "is")):
        code, out, err = _export_cli(capsys, src, dst, "--force")
        assert code == 1 and out == "" and err == (f"error: DST {dst} {where} SRC {src}; write the copy to a folder "
                                                   "outside the source drafter (--force does not change this)\n")
        assert _snapshot(src) == before  # acceptance.md and the d2t weights untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def test_export_cli_bad_src_is_one_line(tmp_path, capsys, tiny_target_dir):
    drafter = _reduced_drafter(tmp_path / "drafter")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(tmp_path / "nope", "no such folder; give the drafter folder"),
             (drafter / "config.json", "is a file; give the drafter folder"),
             (empty, "no config.json in this folder"),
             (tiny_target_dir, f"SRC {tiny_target_dir}: this config.json is a LlamaForCausalLM model's, not a DFlash "
                               "drafter's (no dflash_config): give a DFlash drafter's folder as SRC\n")]  # no --drafter
    for src, msg in cases:
        code, out, err = _export_cli(capsys, src, tmp_path / "out")
        assert code == 1 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err
        assert msg in err and str(src) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_export_cli_help_and_usage_errors():
    import subprocess
    import sys

    import os

    run = [sys.executable, "-m", "dflash_trt.training.export"]
    r = subprocess.run([*run, "--help"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m dflash_trt.training.export [-h] [--format "
                                                     "{zlab,speculators}]")
    assert "[--force] SRC DST" in r.stdout and "full-vocabulary" in r.stdout and "speculators format" in r.stdout
    r = subprocess.run(run, capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "" and "the following arguments are required: SRC, DST" in r.stderr
    assert "Traceback" not in r.stderr


def test_export_copies_only_drafter_files_and_names_the_rest(tmp_path, capsys):
    """The copy takes training.json, loss.png, the evaluation cache (keyed by weights: the copy's differ) but
    not acceptance.* nor a user's own files and folders (it copied NOTES.txt, so a later --force over the
    copy was refused); those are named on stderr, and the copy can be replaced by --force."""
    src = _reduced_drafter(tmp_path / "drafter")
    for name, data in (("training.json", b'{"steps": 3}'), ("loss.png", b"png"), ("eval_cache.json", b"{}"),
                       ("acceptance.md", b"| tau |"), ("NOTES.txt", b"mine")):
        (src / name).write_bytes(data)
    (src / "runs").mkdir()
    dst = tmp_path / "full"
    code, out, err = _export_cli(capsys, src, dst)
    assert code == 0 and out == f"wrote the full-vocabulary copy of {src} to {dst}\n", err
    assert err == ("not copied, as dflash-trt does not write them in a drafter folder (2 entries): NOTES.txt, runs/; "
                   "copy what you need yourself\n")
    assert sorted(p.name for p in dst.iterdir()) == ["README.md", "config.json", "eval_cache.json", "loss.png",
                                                     "model.safetensors", "training.json"]
    assert (dst / "training.json").read_bytes() == b'{"steps": 3}' and (dst / "loss.png").read_bytes() == b"png"
    code, out, err = _export_cli(capsys, src, dst, "--force")  # the copy holds only drafter files
    assert code == 0, err


def test_loss_plot_of_one_logged_step_draws_its_points(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from dflash_trt.training.export import plot_loss

    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    plot_loss([{"step": 4, "loss": 14.4, "hard_ce": 14.3, "accepted": 0.1}], tmp_path / "loss.png")
    lines = figs[0].axes[0].get_lines() + figs[0].axes[1].get_lines()
    assert [line.get_marker() for line in lines] == ["o", "o", "o"]  # one point each: visible only as a marker
