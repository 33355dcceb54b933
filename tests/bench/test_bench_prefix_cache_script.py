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
    (["--document", "500", "--num-prompts", "1"], "--document needs --num-prompts >= 2 (the first question fills the "
                                                 "cache), got 1"),
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


def test_document_questions_reuse_the_documents_kv(tmp_path):
    """--document: questions after the first read the document's K/V from the cache (all but their own question's
    tokens), with the same outputs as without it; the JSON has both settings' times."""
    import json

    out = tmp_path / "doc.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--document", "300", "--num-prompts", "2", "--max-tokens", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    d = json.loads(out.read_text())
    assert d["identical"] and d["document_tokens"] >= 300 and d["num_prompts"] == 2
    on = d["runs"]["on"]
    assert on[0]["cached_tokens"] == 0 < d["document_tokens"] <= on[1]["cached_tokens"] < on[1]["prompt_tokens"]
    assert all(r["cached_tokens"] == 0 for r in d["runs"]["off"])
    assert d["ratios_off_over_on"]["ttft_median"] == d["ttft_median_s"]["off"] / d["ttft_median_s"]["on"]
