"""Durable writes (`files.atomic_write`): the data written is fsynced before the rename, the folder
after it, and a failed write leaves the previous file and no temporary; the trainer's checkpoints
and the data cache's shards go through it."""

import json
import os
import re
import stat

import pytest
import torch

from tests.training.conftest import EOS, MASK
from dflash_trt import files
from dflash_trt.files import LOCK_FILE, atomic_write, write_json_atomic
from dflash_trt.models.checkpoints import new_drafter_config
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.runtime.engine import Engine
from dflash_trt.training.datagen import generate_dataset
from dflash_trt.training.pipeline import make_train_data
from dflash_trt.training.trainer import CHECKPOINT, TrainConfig, train


class _Fsyncs:
    """Records every os.fsync the files module makes: (inode, is a folder, size, the names in
    `folder` at that moment), then fsyncs for real."""

    def __init__(self, monkeypatch, folder):
        self.calls = []
        self.folder = folder
        real = os.fsync

        def fsync(fd):
            st = os.fstat(fd)
            self.calls.append((st.st_ino, stat.S_ISDIR(st.st_mode), st.st_size,
                               sorted(p.name for p in folder.iterdir())))
            real(fd)
        monkeypatch.setattr(files.os, "fsync", fsync)


def test_the_file_is_fsynced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    p = tmp_path / "state.bin"
    p.write_bytes(b"old")
    syncs = _Fsyncs(monkeypatch, tmp_path)
    with atomic_write(p) as f:
        f.write(b"new contents")
    (ino, is_dir, size, names), (dino, dis_dir, _, dnames) = syncs.calls
    assert (is_dir, size, len(names), names[1]) == (False, len(b"new contents"), 2, "state.bin")  # before the rename
    assert re.fullmatch(rf"\.state\.bin\.{os.getpid()}\.[0-9a-f]{{8}}\.tmp", names[0])  # the unique temporary
    assert ino == p.stat().st_ino  # the file fsynced is the one now at `path`
    assert (dino, dis_dir, dnames) == (tmp_path.stat().st_ino, True, ["state.bin"])  # the folder, after it
    assert p.read_bytes() == b"new contents"


def test_json_goes_through_the_same_durable_write(tmp_path, monkeypatch):
    p = tmp_path / "results.json"
    syncs = _Fsyncs(monkeypatch, tmp_path)
    write_json_atomic(p, {"a": 1}, indent=None)
    assert [c[1] for c in syncs.calls] == [False, True] and syncs.calls[0][2] == len('{"a": 1}\n')
    assert json.loads(p.read_text()) == {"a": 1} and [x.name for x in tmp_path.iterdir()] == ["results.json"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_exception_mid_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch, error):
    p = tmp_path / "checkpoint.pt"
    p.write_bytes(b"previous")
    syncs = _Fsyncs(monkeypatch, tmp_path)
    with pytest.raises(error):
        with atomic_write(p) as f:
            f.write(b"half a ")
            raise error
    assert p.read_bytes() == b"previous" and [x.name for x in tmp_path.iterdir()] == ["checkpoint.pt"]
    assert syncs.calls == []  # nothing renamed, nothing to make durable


def test_a_failing_fsync_keeps_the_previous_file(tmp_path, monkeypatch):
    """fsync reporting an I/O error (the data may not be on disk) fails the write before the rename."""
    p = tmp_path / "checkpoint.pt"
    p.write_bytes(b"previous")

    def fsync(fd):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(files.os, "fsync", fsync)
    with pytest.raises(OSError, match="Input/output"):
        with atomic_write(p) as f:
            f.write(b"new")
    assert p.read_bytes() == b"previous" and [x.name for x in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_a_folder_fsync_the_file_system_does_not_support_is_not_an_error(tmp_path, monkeypatch):
    p = tmp_path / "x.json"
    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")  # EINVAL: e.g. some network file systems
        real(fd)
    monkeypatch.setattr(files.os, "fsync", fsync)
    write_json_atomic(p, {"a": 1})
    assert json.loads(p.read_text()) == {"a": 1}


def test_checkpoints_and_shards_are_fsynced(tmp_path, monkeypatch, tiny_target, tiny_prompts):
    """The data cache's shard and manifest, then the trainer's checkpoint: each file fsynced with its
    folder, no temporary left."""
    data_dir, run = tmp_path / "data", tmp_path / "run"
    data_dir.mkdir()
    syncs = _Fsyncs(monkeypatch, data_dir)
    engine = Engine(tiny_target, None, (EOS,))
    generate_dataset(engine, tiny_prompts[:4], data_dir, (0, 1, 3), 6, 4, {"test": True}, False)
    inodes = {ino for ino, is_dir, _, _ in syncs.calls if not is_dir}
    assert {(data_dir / n).stat().st_ino for n in ("shard-00000.pt", "manifest.json")} <= inodes
    assert data_dir.stat().st_ino in {ino for ino, is_dir, _, _ in syncs.calls if is_dir}

    from dflash_trt.training.datagen import load_shards

    data = make_train_data(load_shards(data_dir), (0, 1, 3), (0, 1), tiny_target, None)
    torch.manual_seed(0)
    drafter = DFlashDrafter(new_drafter_config(tiny_target.config, 1, 4, MASK, [0, 1]))
    cfg = TrainConfig(block_size=4, anchors_per_seq=2, seqs_per_step=2, epochs=1, checkpoint_every=1)
    run.mkdir()
    syncs = _Fsyncs(monkeypatch, run)
    train(drafter, data, cfg, run, max_steps=1, progress=False)
    ckpt = run / CHECKPOINT
    assert (ckpt.stat().st_ino, False) in {(ino, is_dir) for ino, is_dir, _, _ in syncs.calls}
    assert (run.stat().st_ino, True) in {(ino, is_dir) for ino, is_dir, _, _ in syncs.calls}
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, CHECKPOINT]  # folder_lock's .lock
    assert torch.load(ckpt, weights_only=False)["state"]["step"] == 1
