"""The output folder of `dflash-trt init-drafter`, `dflash-trt train-drafter` and `python -m
dflash_trt.training.export` (`dflash_trt.out_folder`, the rule `dflash-trt build` has too): --force replaces
only a DFlash drafter folder holding nothing but what dflash-trt writes there, or an empty folder; an
unusable --out (or --work-dir) is refused with one line before any work, and nothing is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt.training.export import main as export_main
from tests.conftest import run_main
from tests.training.conftest import MASK, VOCAB

COMMANDS = ("init-drafter", "train-drafter", "export")


@pytest.fixture
def cli(tmp_path, tmp_path_factory, monkeypatch, capsys, target_with_tokenizer):
    """run(command, out, *extra) -> (exit code, stdout, stderr) for each of COMMANDS, run in tmp_path/"run"
    (the current folder; run.here) with its inputs elsewhere (a prompts file, a drafter as SRC)."""
    inputs, here = tmp_path_factory.mktemp("inputs"), tmp_path / "run"
    here.mkdir()
    prompts = inputs / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{(7 * i + j) % (VOCAB - 4) + 4}" for j in range(6))})
                               + "\n" for i in range(8)))
    src = inputs / "src"
    code, _, err = run_main(monkeypatch, capsys, *_init_args(target_with_tokenizer, src))
    assert code == 0, err
    monkeypatch.chdir(here)

    def run(command, out, *extra):
        if command == "export":
            try:
                export_main([str(src), str(out), *extra])
                code = 0
            except SystemExit as exc:
                code = exc.code
            got = capsys.readouterr()
            return code, got.out, got.err
        args = (_init_args(target_with_tokenizer, out) if command == "init-drafter" else
                ("train-drafter", "--target", str(target_with_tokenizer), "--out", str(out), "--prompts", str(prompts),
                 "--num-layers", "1", "--block-size", "4", "--epochs", "1", "--target-layer-ids", "0,1",
                 "--max-new-tokens", "8", "--mask-token-id", str(MASK), "--init", "random", "--max-steps", "1"))
        return run_main(monkeypatch, capsys, *args, *extra)

    run.here = here
    return run


def _init_args(target, out):
    return ("init-drafter", "--target", str(target), "--out", str(out), "--mask-token-id", str(MASK),
            "--target-layer-ids", "0,2")


def _flag(command):
    return "DST" if command == "export" else "--out"


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` (hidden ones included) -> its bytes (None for a folder)."""
    return {p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def _one_error_line(code, err, want):
    """Exit 1 and a single `error: ...` line holding `want`: no traceback, no raw '[Errno N]'."""
    return (code == 1 and err.count("\n") == 1 and err.startswith("error: ") and want in err
            and "Traceback" not in err and "[Errno" not in err)


@pytest.mark.parametrize("command", COMMANDS)
def test_force_never_deletes_a_users_folder(cli, command):
    """`mkdir danger && echo precious > danger/sentinel.txt && CMD --out danger --force` deleted sentinel.txt
    (the folder was replaced by the drafter); now it is refused in one line and nothing changes."""
    danger = cli.here / "danger"
    danger.mkdir()
    (danger / "sentinel.txt").write_text("precious\n")
    code, _, err = cli(command, "danger", "--force")
    assert _one_error_line(code, err, f"{_flag(command)} danger is a folder that is not a DFlash drafter folder (no "
                                      "config.json of a DFlashDraftModel); --force replaces only a DFlash drafter folder "
                                      f"or an empty folder, so nothing else is lost: pick another {_flag(command)}, or "
                                      "move it away yourself"), err
    assert _tree(cli.here) == {"danger": None, "danger/sentinel.txt": b"precious\n"}  # no work dir, no temporary folder


def test_the_export_module_keeps_a_users_folder_as_a_subprocess(tmp_path, target_with_tokenizer):
    """The report's own reproduction, through `python -m dflash_trt.training.export SRC DST --force`."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter, new_drafter_config

    src = tmp_path / "src"
    init_drafter(new_drafter_config(TargetConfig.from_pretrained(target_with_tokenizer), 1, 4, MASK, [0, 2]), src)
    danger = tmp_path / "danger"
    danger.mkdir()
    (danger / "sentinel.txt").write_text("precious\n")
    r = subprocess.run([sys.executable, "-m", "dflash_trt.training.export", str(src), str(danger), "--force"],
                       capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert _one_error_line(r.returncode, r.stderr, "so nothing else is lost"), r.stderr
    assert (danger / "sentinel.txt").read_text() == "precious\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "danger", "src"]


@pytest.mark.parametrize("command", ("init-drafter", "export"))
def test_force_replaces_a_drafter_folder_only_without_other_files(cli, command):
    """A drafter folder with a file dflash-trt does not write there (a user's notes, an engine folder) is
    refused, the files counted and the first few named; without them (acceptance.* and the evaluate
    cache are dflash-trt's own) --force replaces it."""
    flag = _flag(command)
    assert cli(command, "d")[0] == 0
    (cli.here / "d" / "NOTES.txt").write_text("mine")
    code, _, err = cli(command, "d", "--force")
    assert _one_error_line(code, err, f"{flag} d is a DFlash drafter folder plus 1 file that dflash-trt does not write "
                                      "there (NOTES.txt); --force replaces only a DFlash drafter folder or an empty "
                                      f"folder, so nothing else is lost: pick another {flag}, or move those files away "
                                      "yourself"), err
    (cli.here / "d" / "engine").mkdir()
    for name in ("a.engine", "b.engine", "c.engine"):
        (cli.here / "d" / "engine" / name).write_text(name)
    before = _tree(cli.here)
    code, _, err = cli(command, "d", "--force")
    assert _one_error_line(code, err, "plus 4 files that dflash-trt does not write there (NOTES.txt, engine/a.engine, "
                                      "engine/b.engine, ...)"), err
    assert _tree(cli.here) == before
    (cli.here / "d" / "NOTES.txt").unlink()
    for p in sorted((cli.here / "d" / "engine").iterdir()):
        p.unlink()
    (cli.here / "d" / "runs" / "empty").mkdir(parents=True)  # an empty folder of the user's: kept too (it went
    code, _, err = cli(command, "d", "--force")              # silently)
    assert _one_error_line(code, err, "plus 2 files that dflash-trt does not write there (engine/, runs/empty/)"), err
    (cli.here / "d" / "runs" / "empty").rmdir()
    (cli.here / "d" / "runs").rmdir()
    (cli.here / "d" / "engine").rmdir()
    for name in ("acceptance.json", "acceptance.md", "acceptance.png", "eval_cache.json", "training.json", "loss.png"):
        (cli.here / "d" / name).write_text("{}")
    code, _, err = cli(command, "d", "--force")
    assert code == 0, err
    assert not (cli.here / "d" / "acceptance.json").exists() and sorted(p.name for p in cli.here.iterdir()) == ["d"]


def test_train_drafter_force_replaces_a_drafter_folder_with_evaluate_results(cli):
    """train-drafter --force over a drafter folder holding what the exporter and evaluate write: replaced."""
    assert cli("init-drafter", "d")[0] == 0
    (cli.here / "d" / "acceptance.md").write_text("| tau |")
    code, out, err = cli("train-drafter", "d", "--force")
    assert code == 0, err
    assert "wrote trained drafter to d" in out and not (cli.here / "d" / "acceptance.md").exists()


def _bad_outs(here: Path) -> list[tuple[str, str]]:
    """(--out, its error line after `error: FLAG `) for outs that no command can write."""
    (here / "afile").write_text("x")
    (here / "eng1").mkdir()
    (here / "eng1" / "manifest.json").write_text(json.dumps({"kind": "dflash-trt-bundle", "schema_version": 1,
                                                              "files": {}}))
    (here / "drf").mkdir()  # a drafter folder (its config.json names DFlashDraftModel)
    (here / "drf" / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    cases = [("", "is empty; give a folder path"),
             (".", ". names the current folder, which is never replaced; give the name of a new folder"),
             ("..", ".. names a folder above the current one"),
             ("afile/sub", "afile/sub: afile is a file, not a folder;"),
             ("afile/x/sub", "afile/x/sub: afile is a file, not a folder;"),
             ("eng1/sub", f"eng1/sub is inside the dflash-trt bundle {here.resolve() / 'eng1'}; give a path outside it"),
             ("drf/sub", f"drf/sub is inside the DFlash drafter folder {here.resolve() / 'drf'}; give a path outside it"),
             ("drf/x/..", f"drf/x/.. names {here.resolve() / 'drf'} through '..', which is never replaced")]
    if Path("/proc/self").is_dir():  # root may write anywhere by its access bits, yet mkdir fails in /proc
        cases.append(("/proc/xx", "/proc/xx: cannot write in /proc ("))
    return cases  # the error line is `error: FLAG ` and the text


@pytest.mark.parametrize("command,extra", [("init-drafter", ()), ("init-drafter", ("--force",)),
                                           ("train-drafter", ()), ("train-drafter", ("--force",)),
                                           ("train-drafter", ("--data-only",)), ("export", ()), ("export", ("--force",))])
def test_an_unusable_out_is_refused_in_one_line_before_any_work(cli, command, extra):
    """An empty --out (an unset $OUT), '.', '..', a path under a file, inside a bundle or in /proc: one line, exit
    1, before the target loads or any data is generated (train-drafter wrote a data cache into '..work' and
    trained before a traceback; init-drafter built the drafter before '[Errno 17] File exists')."""
    for out, want in _bad_outs(cli.here):
        before = _tree(cli.here)
        code, stdout, err = cli(command, out, *extra)
        assert _one_error_line(code, err, f"error: {_flag(command)} {want}"), (out, err)
        assert stdout == "" and _tree(cli.here) == before, out


@pytest.mark.parametrize("extra", [(), ("--data-only",)])
def test_an_unusable_work_dir_is_refused_before_any_work(cli, extra):
    """--work-dir a file ('[Errno 20] Not a directory' after loading the target), or --out itself or a folder
    inside it (the export replaces --out, and the data cache with it): one line, nothing written."""
    (cli.here / "afile").write_text("x")
    cases = [(("--work-dir", "afile"), "--work-dir afile: afile is a file, not a folder; give a folder path"),
             (("--work-dir", "afile/w"), "--work-dir afile/w: afile is a file, not a folder"),
             (("--work-dir", "d/w"), "--work-dir d/w is inside --out d; the export replaces --out as a whole"),
             (("--work-dir", "d"), "--work-dir d is --out d;")]
    (cli.here / "drf").mkdir()  # a drafter folder
    (cli.here / "drf" / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    cases.append((("--work-dir", "drf/w"), f"--work-dir drf/w is inside the DFlash drafter folder "
                                           f"{(cli.here / 'drf').resolve()}; give a path outside it"))
    for args, want in cases:
        code, _, err = cli("train-drafter", "d", *args, *extra)
        assert _one_error_line(code, err, want), (args, err)
        assert sorted(p.name for p in cli.here.iterdir()) == ["afile", "drf"], args
        assert sorted(p.name for p in (cli.here / "drf").iterdir()) == ["config.json"], args


def test_train_drafter_checks_out_again_before_the_export(cli, monkeypatch):
    """A file put into --out while the run trained (hours, on a real target): the export refuses to replace
    it, in one line saying the run is checkpointed; once it is gone, --resume exports that run."""
    import dflash_trt.training.trainer as trainer

    real_train = trainer.train

    def train_then_add_notes(*args, **kwargs):
        state = real_train(*args, **kwargs)
        (cli.here / "d" / "NOTES.txt").write_text("written while it trained")
        return state

    (cli.here / "d").mkdir()
    monkeypatch.setattr(trainer, "train", train_then_add_notes)
    code, _, err = cli("train-drafter", "d", "--force")
    err = err[err.index("error: "):]  # after the progress bars of data generation and training
    assert _one_error_line(code, err, "error: --out d is a folder that is not a DFlash drafter folder"), err
    assert err.endswith("; nothing was exported: the run is checkpointed at step 1 in d.work/run, so once --out is "
                        "fixed, rerun the same command with --resume to export it\n"), err
    assert sorted(p.name for p in (cli.here / "d").iterdir()) == ["NOTES.txt"]
    monkeypatch.setattr(trainer, "train", real_train)
    (cli.here / "d" / "NOTES.txt").unlink()
    code, out, err = cli("train-drafter", "d", "--force", "--resume")
    assert code == 0 and "wrote trained drafter to d (weights of step 1; UNFINISHED: stopped at step 1 of" in out, err


@pytest.mark.parametrize("command", COMMANDS)
def test_force_through_a_link_replaces_the_folder_it_names(cli, command):
    """--out LINK --force, LINK -> a drafter folder: that folder gets the new drafter and the link stays (the
    link itself was replaced, leaving the folder it names stale), as build does for a bundle; a link to nothing
    is refused."""
    real, link = cli.here / "real", cli.here / "link"
    code, _, err = cli("init-drafter", real)
    assert code == 0, err
    before = (real / "model.safetensors").stat().st_mtime_ns
    (real / "model.safetensors").write_bytes((real / "model.safetensors").read_bytes())  # a new mtime to compare
    old = (real / "model.safetensors").stat().st_mtime_ns
    assert old >= before
    link.symlink_to(real)
    code, _, err = cli(command, link, "--force")
    assert code == 0, err
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert (real / "model.safetensors").stat().st_mtime_ns != old and (real / "config.json").is_file()
    work = ["link.work"] if command == "train-drafter" else []  # train-drafter's default --work-dir
    assert sorted(p.name for p in cli.here.iterdir()) == ["link", *work, "real"]  # no temporary left
    broken = cli.here / "broken"
    broken.symlink_to(cli.here / "nowhere")
    code, _, err = cli(command, broken, "--force")
    assert code != 0 and "is a symbolic link to" in err and "which does not exist" in err, err


@pytest.mark.parametrize("out,why", [
    ("~/my-drafter", "'~' is not expanded here"),
    ("HERE", "names the current folder, which is never replaced"),
    ("PARENT", "names a folder above the current one, which is never replaced"),
])
def test_tilde_and_the_current_folder_by_any_spelling_are_refused(cli, out, why):
    """'~' in quotes reaches the command unexpanded (it made a folder named '~'); "$PWD" or an absolute path
    above it names the current folder as surely as '.' does (--force would delete the shell's folder)."""
    out = {"HERE": str(cli.here), "PARENT": str(cli.here.parent)}.get(out, out)
    for command in COMMANDS:
        code, _, err = cli(command, out, "--force")
        assert code != 0 and why in err and "Traceback" not in err, (command, err)
    assert not (cli.here / "~").exists() and sorted(cli.here.iterdir()) == []


def test_an_out_inside_a_targets_folder_is_warned_and_written(cli):
    """A drafter kept inside its target's folder is a layout some choose: written, with one warning that it travels
    with the model's files (a drafter folder or a bundle as the parent is refused: above)."""
    model = cli.here / "mdl"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, _, err = cli("init-drafter", "mdl/dflash")
    assert code == 0, err
    assert f"warning: --out mdl/dflash is inside the model folder {model.resolve()}; the new folder travels with" in err
    assert (model / "dflash" / "config.json").is_file()
    code, _, err = cli("train-drafter", "d", "--work-dir", "mdl/work", "--data-only")  # its data cache too: warned
    assert code == 0 and f"warning: --work-dir mdl/work is inside the model folder {model.resolve()}" in err, err
    code, _, err = cli("train-drafter", "mdl/trained", "--work-dir", "w2")  # --out is checked twice: warned once
    assert code == 0 and err.count("warning: --out mdl/trained is inside the model folder") == 1, err
    assert (model / "trained" / "model.safetensors").is_file()


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("command", COMMANDS)
def test_what_appears_at_out_while_the_command_writes_is_kept(cli, monkeypatch, command, force):
    """A file put at --out while the command wrote its folder (a user's, or another run with the same --out that
    finished first) was replaced by the rename at the end, the command reporting success. Now --out is checked
    again before the rename: it stays as it is and the new drafter goes to OUT.new, named by the one error line."""
    import dflash_trt.models.checkpoints as checkpoints
    import dflash_trt.training.export as export

    def save_then_user_writes(module):
        real = module.save_checkpoint

        def save(*args, **kwargs):
            real(*args, **kwargs)
            (cli.here / "d").write_text("my notes\n")  # while the drafter is being written beside it
        monkeypatch.setattr(module, "save_checkpoint", save)

    save_then_user_writes(checkpoints)
    save_then_user_writes(export)
    code, _, err = cli(command, "d", *(["--force"] if force else []))
    err = err[err.index("error: "):]  # train-drafter: after its progress bars
    flag = _flag(command)
    ran, product = {"init-drafter": ("init-drafter", "new drafter"), "export": ("the export", "new drafter"),
                    "train-drafter": ("train-drafter's export", "trained drafter")}[command]
    refused = ("--force does not replace (only a DFlash drafter folder of its own files, or an empty folder)" if force
               else "is not replaced without --force")
    assert _one_error_line(code, err, f"error: {flag} d changed while {ran} ran: it is now a file, not a DFlash drafter folder, which {refused}; it "
                                      f"is left as it is, and the {product} is at d.new (move it where you want it)"), err
    assert (cli.here / "d").read_text() == "my notes\n"
    cfg = json.loads((cli.here / "d.new" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and (cli.here / "d.new" / "model.safetensors").is_file()
    assert not [p.name for p in cli.here.iterdir() if p.name.startswith(".")]  # no temporary folder left
