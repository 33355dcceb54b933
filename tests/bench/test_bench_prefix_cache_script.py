"""build_scripts/bench_prefix_cache.py: bad counts and an unusable --out are usage errors before the model loads
(they failed after the whole run: an empty median, a traceback opening --out, or silently fewer conversations)."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "build_scripts" / "bench_prefix_cache.py"


@pytest.mark.parametrize("args,msg", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1 and <= 80 (MT-Bench's questions), got 0"),
    (["--num-prompts", "81"], "--num-prompts must be >= 1 and <= 80 (MT-Bench's questions), got 81"),
    (["--burst", "2", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["--out", "{tmp}"], "--out {tmp} is a folder; give the path of the JSON file to write (e.g. {tmp}/prefix_cache.json)"),
    (["--out", "{tmp}/notes.txt/x.json"], "--out {tmp}/notes.txt/x.json: its folder {tmp}/notes.txt: this is a file, "
                                          "not a folder"),
])
def test_bad_arguments_stop_before_the_model_loads(tmp_path, args, msg):
    (tmp_path / "notes.txt").write_text("x")
    args = [a.format(tmp=tmp_path) for a in args]
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.splitlines()[-1].startswith(f"bench_prefix_cache.py: error: {msg.format(tmp=tmp_path)}"), run.stderr
    assert run.stdout == "" and (tmp_path / "notes.txt").read_text() == "x"
