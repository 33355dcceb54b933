"""init-drafter and train-drafter on a full disk (ENOSPC, raised where the write happens): one line naming the
path and the fix, exit 1, nothing half-written at --out, and a train-drafter run's work kept for the rerun."""

from __future__ import annotations

import errno
import os

from click.testing import CliRunner

from dflash_trt.cli import cli
from dflash_trt.errors import ConfigError
from tests.cli.test_disk_full import ENOSPC, safetensor_error
from tests.training.conftest import MASK
from tests.training.test_cli import _prompts


def no_space(monkeypatch):
    """safetensors' save_file fails as on a full disk (its SafetensorError names no file, nor an errno)."""
    import dflash_trt.models.loading

    def save_file(*args, **kwargs):
        raise safetensor_error()

    monkeypatch.setattr(dflash_trt.models.loading, "save_file", save_file)


def test_init_drafter_on_a_full_disk_names_out_and_the_fix(tmp_path, target_with_tokenizer, monkeypatch):
    no_space(monkeypatch)
    for out in (tmp_path / "d", tmp_path / "new" / "a" / "d"):  # an --out whose parents the run creates too
        res = CliRunner().invoke(cli, ["init-drafter", "--target", str(target_with_tokenizer), "--out", str(out),
                                       "--num-layers", "1", "--target-layer-ids", "0,1", "--mask-token-id", str(MASK)])
        assert isinstance(res.exception, ConfigError), repr(res.exception)
        assert str(res.exception) == (f"cannot write the drafter to --out {out} ({ENOSPC}); free space there, or give "
                                      f"another --out; nothing was written to {out}")
        assert list(tmp_path.iterdir()) == []  # no temporary folder, no --out, no parent folder it made


def test_train_drafter_on_a_full_disk_keeps_the_data_and_the_checkpoint(tmp_path, target_with_tokenizer, monkeypatch):
    out, work = tmp_path / "d", tmp_path / "w"
    args = ["train-drafter", "--target", str(target_with_tokenizer), "--out", str(out), "--work-dir", str(work),
            "--prompts", str(_prompts(tmp_path, 8)), "--num-layers", "1", "--block-size", "4", "--epochs", "1",
            "--target-layer-ids", "0,1", "--max-new-tokens", "4", "--mask-token-id", str(MASK), "--anchors", "4",
            "--init", "random", "--gen-batch-size", "8"]
    real_fsync = os.fsync

    def fsync(fd):  # the first data shard's write fails
        if "shard-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, ENOSPC)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    res = CliRunner().invoke(cli, args)
    assert isinstance(res.exception, ConfigError), repr(res.exception)
    assert str(res.exception) == (f"cannot write {work / 'data' / 'shard-00000.pt'} ({ENOSPC}); free space there, or "
                                  f"rerun with another --work-dir to start over; the finished data shards in "
                                  f"{work / 'data'} are kept: rerun the same command to continue")
    monkeypatch.setattr(os, "fsync", real_fsync)
    no_space(monkeypatch)  # the export fails: the run is checkpointed, and --resume exports it
    res = CliRunner().invoke(cli, args)
    assert isinstance(res.exception, ConfigError), repr(res.exception)
    assert str(res.exception).startswith(f"cannot write the drafter to --out {out} ({ENOSPC}); free space there, or "
                                         f"give another --out (with --work-dir {work}) to the rerun; nothing was "
                                         f"exported: the run is checkpointed at step "), str(res.exception)
    assert str(res.exception).endswith(f"in {work / 'run'}, so rerun the same command with --resume to export it")
    assert not out.exists() and not list(tmp_path.glob(".d.tmp-*"))
    monkeypatch.undo()
    res = CliRunner().invoke(cli, args + ["--resume"])
    assert res.exit_code == 0 and (out / "model.safetensors").is_file(), res.output + repr(res.exception)


def test_train_drafter_checkpoint_on_a_full_disk_says_what_a_rerun_continues_from(tmp_path, target_with_tokenizer,
                                                                                  monkeypatch):
    """ENOSPC while training writes a checkpoint: the first one (nothing to resume: the data cache is kept, rerun
    the same command) and a later one (the last whole checkpoint is kept: rerun with --resume, which then
    finishes)."""
    out, work = tmp_path / "d", tmp_path / "w"
    args = ["train-drafter", "--target", str(target_with_tokenizer), "--out", str(out), "--work-dir", str(work),
            "--prompts", str(_prompts(tmp_path, 8)), "--num-layers", "1", "--block-size", "4", "--epochs", "2",
            "--target-layer-ids", "0,1", "--max-new-tokens", "4", "--mask-token-id", str(MASK), "--anchors", "4",
            "--init", "random", "--gen-batch-size", "8", "--checkpoint-every", "1", "--seqs-per-step", "2"]
    real_fsync, writes = os.fsync, {"n": 0}

    def fsync(fd, fail_at):  # the fail_at-th checkpoint's write fails
        if "checkpoint.pt" in os.readlink(f"/proc/self/fd/{fd}"):
            writes["n"] += 1
            if writes["n"] == fail_at:
                raise OSError(errno.ENOSPC, ENOSPC)
        return real_fsync(fd)

    checkpoint = work / "run" / "checkpoint.pt"
    monkeypatch.setattr(os, "fsync", lambda fd: fsync(fd, 1))
    res = CliRunner().invoke(cli, args)
    assert isinstance(res.exception, ConfigError), repr(res.exception)
    assert str(res.exception).endswith(f"({ENOSPC}); free space there, or rerun with another --work-dir to start "
                                       f"over; no checkpoint was written yet; the data cache in {work / 'data'} is "
                                       "kept: rerun the same command to train again"), str(res.exception)
    assert not checkpoint.exists() and not out.exists() and any((work / "data").iterdir())

    import shutil

    shutil.rmtree(work / "run")  # a new run over the kept data; its second checkpoint fails
    writes["n"] = 0
    monkeypatch.setattr(os, "fsync", lambda fd: fsync(fd, 2))
    res = CliRunner().invoke(cli, args)
    assert isinstance(res.exception, ConfigError), repr(res.exception)
    assert str(res.exception).endswith(f"the last checkpoint ({checkpoint}) is kept whole: rerun the same command "
                                       "with --resume to continue from it"), str(res.exception)
    assert checkpoint.is_file() and not out.exists()
    monkeypatch.setattr(os, "fsync", real_fsync)
    res = CliRunner().invoke(cli, args + ["--resume"])
    assert res.exit_code == 0 and (out / "model.safetensors").is_file(), res.output + repr(res.exception)
