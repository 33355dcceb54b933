"""dflash_trt.files: write_json_atomic (the file is whole or unchanged, never half-written) and files_as_one_set (a
report's files replaced together or not at all)."""

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


@pytest.mark.parametrize("writer", ["bench", "evaluate"])
def test_reports_are_written_as_one_set(tmp_path, monkeypatch, writer):
    """bench's `write_outputs` and evaluate's `write_report` (`files_as_one_set`): Ctrl-C while the plots are drawn
    left this run's JSON and table beside the earlier run's plots (or none); now the earlier files stay whole, with
    no temporary folder, and a finished write replaces them all."""
    from dflash_trt.bench import report
    from dflash_trt.training import evaluate

    if writer == "bench":
        module, attr, write, names, main = report, "plots", report.write_outputs, report.OUTPUT_NAMES, "results.json"
        content = {"config": {}, "machine": {"threads": 1, "dtype": "float32"}, "datasets": {}}
    else:
        module, attr, write, names = evaluate, "_write_report_files", evaluate.write_report, evaluate.REPORT_NAMES
        main = "acceptance.json"
        content = {"max_tokens": 4, "block_size": 4, "sets": {"tiny": {"prompts": 1, "drafters": {
            "d": {"tau": 1.5, "parity_count": "1/1", "per_position": [0.5, 0.0, 0.0]}}}}}
    out = tmp_path / "out"
    write({**content, "run": 1}, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    before = {name: (out / name).read_bytes() for name in names}
    real = getattr(module, attr)

    def interrupted(*args):
        real(*args)  # the new files exist (in the temporary folder) when Ctrl-C lands
        raise KeyboardInterrupt

    monkeypatch.setattr(module, attr, interrupted)
    with pytest.raises(KeyboardInterrupt):
        write({**content, "run": 2}, out)
    assert {name: (out / name).read_bytes() for name in names} == before
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    monkeypatch.setattr(module, attr, real)
    write({**content, "run": 3}, out)
    assert json.loads((out / main).read_text())["run"] == 3


HOLD = ("import sys, time\nfrom pathlib import Path\nfrom dflash_trt.files import folder_lock\n"
        "with folder_lock(Path(sys.argv[1]), 'test run'):\n    print('held', flush=True)\n    time.sleep(120)\n")


def hold_in_another_process(folder: Path):
    """A process holding `folder_lock(folder)` until killed (returned once it holds it)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_folder_held_by_another_process_is_refused_naming_it_and_freed_when_it_dies(tmp_path):
    """folder_lock: a second holder fails at once naming the first's process id and the fix; once the first is
    killed (SIGKILL: no cleanup ran) the folder is free again, its stale .lock file notwithstanding; in one process
    the lock is free again after the block, an exception included."""
    from dflash_trt.errors import ConfigError
    from dflash_trt.files import folder_lock

    folder = tmp_path / "work" / "run"
    proc = hold_in_another_process(folder)
    try:
        with pytest.raises(ConfigError, match=rf"{folder} is in use by another drafter training \(process {proc.pid}\)"
                                              r".*wait for that one to end, or give this run another folder"):
            with folder_lock(folder, "drafter training"):
                pass
    finally:
        proc.kill()
        proc.wait()
    assert (folder / ".lock").is_file()
    with pytest.raises(RuntimeError):
        with folder_lock(folder, "drafter training"):
            raise RuntimeError("inside")
    with folder_lock(folder, "drafter training"):
        assert (folder / ".lock").read_text() == f"{os.getpid()}\n"


def test_staging_folder_is_removed_and_on_failure_the_parents_it_made_too(tmp_path):
    from dflash_trt.files import staging_folder
    from dflash_trt.models.loading import publish_folder

    out = tmp_path / "new" / "a" / "d"
    with staging_folder(out, "tmp") as tmp:  # published: only out and its parents are left
        assert tmp.parent == out.parent and tmp.name.startswith(".d.tmp-") and list(tmp.iterdir()) == []
        (tmp / "f").write_text("x")
        publish_folder(tmp, out)
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))] == [
        "new", "new/a", "new/a/d", "new/a/d/f"]

    other = tmp_path / "other" / "b" / "d"
    with pytest.raises(KeyboardInterrupt):  # a failure: the folder and the parents it made are gone
        with staging_folder(other, "tmp") as tmp:
            (tmp / "f").write_text("x")
            raise KeyboardInterrupt
    assert not (tmp_path / "other").exists()

    (tmp_path / "kept").mkdir()  # a parent that was there stays, and one another run wrote into
    with pytest.raises(OSError):
        with staging_folder(tmp_path / "kept" / "c" / "d", "tmp") as tmp:
            (tmp_path / "kept" / "c" / "theirs").write_text("y")
            raise OSError("disk full")
    assert sorted(p.name for p in (tmp_path / "kept" / "c").iterdir()) == ["theirs"]

    with staging_folder(tmp_path / "x" / "d", "tmp"):  # not published: the folder goes, the parents it made stay
        pass
    assert list((tmp_path / "x").iterdir()) == []
