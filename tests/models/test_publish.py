"""Publishing output folders (`dflash_trt.models.loading.publish_folder`): a finished folder gets the modes a
plain mkdir / open would give under the umask (mkdtemp makes 0700 folders, safetensors 0600 files, which a
server running as another user cannot read), and replaces whatever was at its path, file or folder, without
leftovers. Real writers: save_checkpoint, export_drafter, `python -m dflash_trt.training.export`, init-drafter."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from dflash_trt.models.loading import current_umask, publish_folder, read_tensors, save_checkpoint, share_modes
from tests.conftest import make_hf_model, run_main, tiny_hf_config


@pytest.fixture
def umask022():
    """Run the test under umask 022 (the usual one), restoring the caller's."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def tree_modes(root) -> dict[str, int]:
    """{path relative to `root` ("." for root): permission bits} of `root` and everything under it."""
    out = {".": stat.S_IMODE(root.lstat().st_mode)}
    for p in sorted(root.rglob("*")):
        if not p.is_symlink():
            out[p.relative_to(root).as_posix()] = stat.S_IMODE(p.lstat().st_mode)
    return out


def assert_shareable(root, scripts=(), folder=0o755, file=0o644) -> dict[str, int]:
    """Every folder under `root` has mode `folder`, every file `file`, the files in `scripts` `folder`
    (executable). Returns the modes."""
    modes = tree_modes(root)
    want = {rel: folder if (root / rel).is_dir() or rel in scripts else file for rel in modes}
    assert modes == want, {rel: (oct(m), oct(want[rel])) for rel, m in modes.items() if m != want[rel]}
    return modes


def finished_folder(parent) -> tuple:
    """A folder written the way our writers write: mkdtemp (0700), a safetensors checkpoint (0600 weights),
    a 0700 script, a 0700 sub-folder. Returns (folder, its modes before publishing)."""
    tmp = Path(tempfile.mkdtemp(prefix=".out.tmp-", dir=parent))
    save_checkpoint(tmp, {"a": 1}, {"w": torch.ones(2, 3)})
    (tmp / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (tmp / "run.sh").chmod(0o700)
    Path(tempfile.mkdtemp(dir=tmp)).joinpath("x.json").write_text("{}")
    return tmp, tree_modes(tmp)


def test_publish_gives_ordinary_modes_under_the_umask(tmp_path, umask022):
    tmp, before = finished_folder(tmp_path)
    # the bug as users met it: mkdtemp folders 0700, safetensors weights 0600
    assert before["."] == 0o700 and before["model.safetensors"] == 0o600 and before["config.json"] == 0o644
    out = publish_folder(tmp, tmp_path / "out")
    assert out == tmp_path / "out" and not tmp.exists()
    assert_shareable(out, scripts=("run.sh",))
    assert torch.equal(read_tensors(out)["w"], torch.ones(2, 3))

    os.umask(0o027)  # a stricter umask is honoured, not widened
    tmp, _ = finished_folder(tmp_path)
    assert_shareable(publish_folder(tmp, tmp_path / "strict"), scripts=("run.sh",), folder=0o750, file=0o640)


def test_current_umask_reads_without_changing_it(umask022):
    os.umask(0o027)
    assert current_umask() == 0o027 and current_umask() == 0o027
    os.umask(0o022)
    assert current_umask() == 0o022


def test_publish_replaces_a_file_or_a_folder_without_leftovers(tmp_path, umask022):
    victim = tmp_path / "victim.jsonl"
    victim.write_text('{"prompt": "x"}\n')
    tmp, _ = finished_folder(tmp_path)
    publish_folder(tmp, victim)
    assert victim.is_dir() and (victim / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.jsonl"]  # no .victim.jsonl.old-PID

    (victim / "stale.txt").write_text("old")
    tmp, _ = finished_folder(tmp_path)
    publish_folder(tmp, victim)
    assert not (victim / "stale.txt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["victim.jsonl"]


def test_share_modes_leaves_symlink_targets_alone(tmp_path, umask022):
    private = tmp_path / "private.txt"
    private.write_text("secret")
    private.chmod(0o600)
    folder = tmp_path / "f"
    folder.mkdir(mode=0o700)
    (folder / "link").symlink_to(private)
    share_modes(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755 and stat.S_IMODE(private.stat().st_mode) == 0o600


def reduced_drafter_config():
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import new_drafter_config

    target = TargetConfig.from_hf_config(tiny_hf_config())
    return new_drafter_config(target, 1, 4, 3, [0, 1]).replace(draft_vocab_size=24)


def test_exported_drafter_and_its_full_vocab_copy_are_readable(tmp_path, umask022):
    """export_drafter (what train-drafter writes) and `python -m dflash_trt.training.export` (full vocabulary)."""
    from dflash_trt.models.drafter import DFlashDrafter
    from dflash_trt.training.export import export_drafter

    torch.manual_seed(0)
    drafter = DFlashDrafter(reduced_drafter_config())
    out = export_drafter(drafter, tmp_path / "drafter", {"steps": 3}, [], extra_files={"notes.txt": "n"})
    modes = assert_shareable(out)
    assert {"config.json", "model.safetensors", "training.json", "README.md", "notes.txt"} <= set(modes)
    out = export_drafter(drafter, tmp_path / "drafter", {"steps": 4}, [])  # replacing an export
    assert_shareable(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]

    full = tmp_path / "deploy" / "full"  # its parent does not exist yet
    r = subprocess.run([sys.executable, "-m", "dflash_trt.training.export", str(out), str(full)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert_shareable(tmp_path / "deploy")
    assert "d2t" not in read_tensors(full) and "draft_vocab_size" not in json.loads((full / "config.json").read_text())
    assert sorted(p.name for p in (tmp_path / "deploy").iterdir()) == ["full"]


def test_init_drafter_output_is_readable(monkeypatch, capsys, tmp_path, umask022):
    _, target = make_hf_model(tmp_path)
    out = tmp_path / "drafters" / "d"
    args = ("init-drafter", "--target", str(target), "--out", str(out), "--target-layer-ids", "1,2")
    code, _, err = run_main(monkeypatch, capsys, *args)
    assert code == 0, err
    assert set(assert_shareable(out)) == {".", "config.json", "model.safetensors"}
    code, _, err = run_main(monkeypatch, capsys, *args, "--block-size", "8", "--force")
    assert code == 0, err
    assert_shareable(out)
    assert json.loads((out / "config.json").read_text())["block_size"] == 8
    assert sorted(p.name for p in out.parent.iterdir()) == ["d"]
