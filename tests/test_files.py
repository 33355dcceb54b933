"""dflash_trt.files.write_json_atomic: the file is whole or unchanged, never half-written."""

import json
import os
import stat
from pathlib import Path

import pytest

from dflash_trt.files import write_json_atomic


def test_writes_and_replaces(tmp_path):
    p = tmp_path / "results.json"
    write_json_atomic(p, {"a": 1})
    assert json.loads(p.read_text()) == {"a": 1}
    write_json_atomic(p, {"a": 2}, indent=None)
    assert p.read_text() == '{"a": 2}\n' and sorted(x.name for x in tmp_path.iterdir()) == ["results.json"]


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    p = tmp_path / "results.json"
    write_json_atomic(p, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(p, {"a": object()})  # not JSON: fails while encoding
    assert json.loads(p.read_text()) == {"a": 1} and sorted(x.name for x in tmp_path.iterdir()) == ["results.json"]

    def interrupted(self, target):  # the temporary file is written, then Ctrl-C before the rename
        assert self.read_text() == '{"a": 3}\n'
        raise KeyboardInterrupt

    monkeypatch.setattr(type(p), "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_json_atomic(p, {"a": 3}, indent=None)
    assert json.loads(p.read_text()) == {"a": 1} and sorted(x.name for x in tmp_path.iterdir()) == ["results.json"]


def test_temporary_names_are_unique_and_the_mode_is_the_umask_default(tmp_path):
    """Two writes of "a.json" and "a.pt" (or two processes writing one file) never share a temporary
    file, and the written file has the permissions a plain open() gives (0666 less the umask)."""
    from dflash_trt.files import atomic_write

    umask = os.umask(0o022)
    try:
        with atomic_write(tmp_path / "a.json", "w") as f1, atomic_write(tmp_path / "a.pt") as f2:
            assert f1.name != f2.name and all(Path(n).parent == tmp_path for n in (f1.name, f2.name))
            f1.write("{}")
            f2.write(b"x")
    finally:
        os.umask(umask)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "a.pt"]
    assert [stat.S_IMODE((tmp_path / n).stat().st_mode) for n in ("a.json", "a.pt")] == [0o644, 0o644]
