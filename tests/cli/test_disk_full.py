"""A full disk (ENOSPC) while a command writes: one line naming the path and the fix, exit 1, no traceback, nothing
half-written left, and no work lost (bench's table is on stdout; the cache holds no half-converted model)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from dflash_trt.cli import main

ENOSPC = os.strerror(errno.ENOSPC)


def safetensor_error():
    """An exception as safetensors raises it on a full disk (its class name, its text; it carries no errno)."""
    return type("SafetensorError", (Exception,), {})(f"Error while serializing: I/O error: {ENOSPC} (os error 28)")


def fake_results() -> dict:
    """What `run_benchmark` returns for one prompt of humaneval in mode ar (enough for the table and plots)."""
    mode = {"acceptance_length": 1.0, "acceptance_rate": None, "drafts_per_step": None, "tokens_per_s": 2.0,
            "mean_ttft_s": 0.1, "identical_to_ar": 1, "prompts": 1}
    return {"datasets": {"humaneval": {"prompts": 1, "modes": {"ar": mode}, "speedup_vs_ar": {"ar": 1.0}}},
            "peak_rss_mb": 100.0}


def test_bench_on_a_full_disk_prints_the_table_then_names_the_file_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    import matplotlib.figure

    import dflash_trt.api
    import dflash_trt.bench.runner

    pipe = types.SimpleNamespace(engine=types.SimpleNamespace(proposer=None, target=types.SimpleNamespace(packed_head=None)),
                                 target_path="t", drafter_path=None)
    monkeypatch.setattr(dflash_trt.api, "load_pipeline", lambda *a, **k: pipe)
    monkeypatch.setattr(dflash_trt.bench.runner, "run_benchmark", lambda *a, **k: fake_results())

    def full(self, *args, **kwargs):  # as a write to a full disk fails: no file named
        raise OSError(errno.ENOSPC, ENOSPC)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    out = tmp_path / "new" / "bench"
    monkeypatch.setattr(sys, "argv", ["dflash-trt", "bench", "--dataset", "humaneval", "--num-prompts", "1",
                                      "--max-tokens", "2", "--modes", "ar", "--out", str(out)])
    with pytest.raises(SystemExit) as exc:
        main()
    captured = capsys.readouterr()
    assert exc.value.code == 1 and "Traceback" not in captured.err
    assert "| humaneval | ar | 1.00 |" in captured.out  # the run's result is on stdout
    assert captured.err.splitlines()[-1] == (
        f"error: cannot write {out / 'tau_histogram.png'} ({ENOSPC}); free space there, or rerun with another --out; "
        f"the table above is this run's result (none of its files was written to {out})")
    assert not (tmp_path / "new").exists()  # the folders this run created are removed again

    out.mkdir(parents=True)  # an earlier run's results: kept whole, and warned of before the run
    (out / "results.json").write_text('{"earlier": true}\n')
    with pytest.raises(SystemExit):
        main()
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (f"warning: --out {out} holds an earlier run's results.json; this run replaces it, "
                                   "results.md and the plots when it ends: to keep them, stop now and rerun with "
                                   "another --out (or move them away)")
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]
    assert (out / "results.json").read_text() == '{"earlier": true}\n'


def test_a_full_disk_while_converting_the_default_model_names_the_cache_folder(tmp_path, monkeypatch):
    import dflash_trt.models.default as default
    from dflash_trt.errors import CheckpointError

    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))

    def convert(gguf, out):  # transformers' save_pretrained: the config written, the weights fail
        (Path(out) / "config.json").write_text("{}")
        raise safetensor_error()

    monkeypatch.setattr(default, "_convert_gguf", convert)
    with pytest.raises(CheckpointError) as exc:
        default.default_target_path()
    assert str(exc.value) == (f"cannot write the dflash-trt cache folder {tmp_path / 'cache' / 'models'} ({ENOSPC}); "
                              "free space there, or set DFLASH_TRT_CACHE (or XDG_CACHE_HOME) to a writable folder")
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # nothing half-written left as if complete


def run_cli(args: list[str], stdout) -> subprocess.CompletedProcess:
    """`python -m dflash_trt ARGS` with `stdout` (a file object or descriptor), stderr captured."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    return subprocess.run([sys.executable, "-m", "dflash_trt", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, env=env, timeout=120)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (every write: ENOSPC)")
def test_output_to_a_full_disk_is_one_line_and_a_closed_pipe_is_quiet():
    with open("/dev/full", "w") as full:
        res = run_cli(["--help"], full)
    assert res.returncode == 1
    assert res.stderr == (f"error: cannot write the output to stdout ({ENOSPC}); free space there, or send it to "
                          "another disk\n")  # no "Exception ignored" at exit
    read, write = os.pipe()
    os.close(read)  # the reader went away (| head)
    try:
        res = run_cli(["--help"], write)
    finally:
        os.close(write)
    assert res.returncode == 1 and res.stderr == ""
