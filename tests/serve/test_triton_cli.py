"""`dflash-trt triton`, the documented way to serve a Triton model repository here: run as a user runs it, it
serves the repository on nvidia-pytriton's tritonserver (greedy output equal to the target's own), passes other
arguments on to tritonserver, and stops on Ctrl-C leaving no process behind; without nvidia-pytriton it says
what to install."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.serve.triton_launch import free_ports
from dflash_trt.serve.triton_repository import write_model_repository
from tests.conftest import run_main

QUESTION = "What is the capital of France? Answer in one sentence."
READY = "Triton ready on "


def processes_naming(path: Path) -> list[int]:
    """The ids of the live processes whose command line names `path` (tritonserver names its model repository,
    its Python-backend stubs their model.py in it)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if str(path).encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:  # gone meanwhile
                pass
    return pids


@pytest.mark.slow
def test_triton_command_serves_the_repository_and_stops_on_ctrl_c(tmp_path, smollm2_pipeline):
    repo = write_model_repository(tmp_path / "repo", "dflash", max_batch_size="1").parent
    beside = Path(sys.executable).parent / "dflash-trt"
    exe = str(beside) if beside.is_file() else shutil.which("dflash-trt")
    assert exe, "the dflash-trt console script is not installed: pip install -e ."
    http, grpc, metrics = free_ports(3)
    log = tmp_path / "triton.log"
    with log.open("w") as out:  # a file, not a pipe: tritonserver's log, unread, would fill a pipe and block it
        proc = subprocess.Popen([exe, "triton", "--model-repository", str(repo), "--http-port", str(http),
                                 "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--exit-timeout-secs=3"],
                                stdout=out, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # Ctrl-C's handler
    try:
        deadline = time.monotonic() + 300
        while READY not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        serving = [pid for pid in processes_naming(repo) if pid != proc.pid]
        assert len(serving) >= 2, serving  # tritonserver and the model's stub, besides the command
        url = f"http://127.0.0.1:{http}"
        [line] = [x for x in log.read_text().splitlines() if x.startswith(READY)]
        assert line == (f"{READY}{url} (POST {url}/v2/models/dflash/generate), gRPC 127.0.0.1:{grpc}, metrics "
                        f"http://127.0.0.1:{metrics}/metrics")
        r = httpx.post(f"{url}/v2/models/dflash/generate", timeout=300,
                       json={"text_input": QUESTION, "apply_chat_template": True, "max_tokens": 24,
                             "exclude_input_in_output": True, "return_num_output_tokens": True})
        assert r.status_code == 200, r.text
        body = r.json()
        [ref] = smollm2_pipeline.generate([smollm2_pipeline.encode_chat(QUESTION)], SamplingParams(max_tokens=24),
                                          mode="ar")
        assert body["text_output"] == ref.text and body["num_output_tokens"] == len(ref.token_ids) > 0
        assert httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).status_code == 200
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 130, text[-3000:]
    assert text.splitlines()[-1] == "triton interrupted (Ctrl-C); tritonserver and its models stopped"
    assert "Traceback" not in text
    assert "| exit_timeout                     | 3 " in text  # an argument passed on, over the command's own 5
    assert processes_naming(repo) == []


@pytest.mark.slow
def test_a_killed_command_leaves_no_server_behind(tmp_path):
    """kill -9 runs no cleanup: tritonserver gets SIGTERM from the system when the command dies (its parent-death
    signal) and stops with its models."""
    repo = write_model_repository(tmp_path / "repo", "dflash", mode="ar").parent
    log = tmp_path / "triton.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_trt", "triton", "--model-repository", str(repo),
                                 "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while READY not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert len([pid for pid in processes_naming(repo) if pid != proc.pid]) >= 2
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while processes_naming(repo):
        assert time.monotonic() < deadline, (processes_naming(repo), log.read_text()[-3000:])
        time.sleep(0.5)


def test_without_pytriton_one_line_names_what_to_install(monkeypatch, capsys, tmp_path):
    """nvidia-pytriton not importable (None in sys.modules: Python's mark for a module that must not import):
    exit 1, one line naming the pip command and NVIDIA's container, no traceback."""
    repo = write_model_repository(tmp_path / "repo", "dflash").parent
    monkeypatch.setitem(sys.modules, "pytriton", None)
    code, out, err = run_main(monkeypatch, capsys, "triton", "--model-repository", str(repo), "--http-port", "0",
                              "--grpc-port", "0", "--metrics-port", "0")
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: tritonserver not found: nvidia-pytriton, which carries it, is not installed; "
                          "install it with `pip install --no-deps nvidia-pytriton==0.7.0` (`make install` does), or "
                          "serve the repository from NVIDIA's Triton container"), err
    assert "`tritonserver --model-repository DIR`" in err


def test_a_missing_repository_is_a_usage_error(monkeypatch, capsys, tmp_path):
    code, out, err = run_main(monkeypatch, capsys, "triton", "--model-repository", str(tmp_path / "nope"))
    assert code == 2 and err.count("\n") == 1 and "'--model-repository': Directory" in err, err


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port", "--metrics-port"])
def test_a_port_in_use_is_refused_before_tritonserver_starts(monkeypatch, capsys, tmp_path, flag):
    """A port another server holds: a usage error naming its option, before anything starts (tritonserver found it
    only after loading the model, and the ready check was answered by the server holding the HTTP port, so the
    command said "Triton ready" and then died)."""
    import socket

    repo = write_model_repository(tmp_path / "repo", "dflash").parent
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        ports = {"--http-port": "0", "--grpc-port": "0", "--metrics-port": "0", flag: str(port)}
        code, out, err = run_main(monkeypatch, capsys, "triton", "--model-repository", str(repo),
                                  *[x for item in ports.items() for x in item])
    assert (code, out) == (2, ""), err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}: Address already in use; pick another {flag} (or "
                          "stop the server that holds it)"), err
