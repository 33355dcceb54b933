"""dflash_trt.files.write_json_atomic: the file is whole or unchanged, never half-written."""

import json

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
