"""`dflash-trt serve` as a user starts it: the real console script in its own process, real HTTP."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import run_main
from tests.serve.test_openai_server import free_port


def test_a_port_in_use_is_named_before_the_models_load(monkeypatch, capsys):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        start = time.perf_counter()
        code, out, err = run_main(monkeypatch, capsys, "serve", "--port", str(port))
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in err and "pick another --port" in err
    assert time.perf_counter() - start < 5  # refused at once, not after loading the models


def test_an_unknown_host_is_named(monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "serve", "--host", "no-such-host.invalid")
    assert code == 2 and "--host no-such-host.invalid" in err


def test_help_lists_the_endpoints(monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "serve", "--help")
    assert code == 0
    for word in ("/v1/chat/completions", "/v1/responses", "/prometheus/metrics", "/perf_metrics", "--max-batch-size",
                 "--served-model-name", "--bundle", "--api-key", "DFLASH_TRT_API_KEY"):
        assert word in out


@pytest.mark.parametrize("key", ["", "   ", "a\nb", " key "])
def test_an_empty_api_key_is_refused_before_the_models_load(monkeypatch, capsys, key):
    monkeypatch.setenv("DFLASH_TRT_API_KEY", key)  # the environment's, as a deployment sets it
    start = time.perf_counter()
    code, out, err = run_main(monkeypatch, capsys, "serve")
    assert code == 2 and "--api-key (or DFLASH_TRT_API_KEY) is empty, holds control characters, or starts" in err
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("name", ["", "  "])
def test_a_blank_served_model_name_is_refused_before_the_models_load(monkeypatch, capsys, name):
    code, out, err = run_main(monkeypatch, capsys, "serve", "--served-model-name", name)
    assert code == 2 and err == (f"error: Invalid value for '--served-model-name': {name!r} is blank: clients could not "
                                 "name it; give a name, or leave the option out to serve as the bundle's or the target "
                                 "folder's name (see 'dflash-trt serve --help')\n"), err


def wait_until_healthy(proc: subprocess.Popen, base: str, seconds: float = 300) -> None:
    """Until GET base/health answers 200; fails with the server's stderr if it exits first."""
    deadline = time.time() + seconds
    while True:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "the server did not come up"
        time.sleep(0.5)


@pytest.mark.slow
def test_serve_answers_over_http_and_stops_on_sigint():
    from openai import OpenAI

    beside = Path(sys.executable).parent / "dflash-trt"
    exe = str(beside) if beside.is_file() else shutil.which("dflash-trt")
    assert exe, "the dflash-trt console script is not installed: pip install -e ."
    port = free_port()
    proc = subprocess.Popen([exe, "serve", "--port", str(port), "--served-model-name", "smol", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, base)
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
                                           max_tokens=24, temperature=0)
        assert "Paris" in r.choices[0].message.content
        assert [m.id for m in client.models.list()] == ["smol"]
    finally:
        err = stop_with_sigint(proc)
    assert proc.returncode == 0, err
    assert "serving 'smol'" in err


def stop_with_sigint(proc: subprocess.Popen) -> str:
    """Ctrl-C a server started with stderr piped, as a user stops it; its stderr (killed after 60 s)."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_a_host_of_another_machine_is_named(monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "serve", "--host", "192.0.2.1", "--port", str(free_port()))
    assert code == 2 and "--host 192.0.2.1 is not an address of this machine" in err


def test_torchrun_without_a_matching_tp_size_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    code, out, err = run_main(monkeypatch, capsys, "generate", "--chat", "Hi", "--max-tokens", "2")
    assert code == 2 and "one of 3 processes started by torchrun, but --tp-size is 1: pass --tp-size 3" in err
    code, out, err = run_main(monkeypatch, capsys, "serve", "--port", str(free_port()))
    assert code == 2 and "one of 3 processes started by torchrun, but --tp-size is 1: pass --tp-size 3" in err
    monkeypatch.delenv("WORLD_SIZE")
    code, out, err = run_main(monkeypatch, capsys, "serve", "--tp-size", "3", "--port", str(free_port()))
    assert code == 2 and "--tp-size 3 runs one process per rank: launch it with torchrun --nproc-per-node 3" in err
    # a split SmolLM2 (9 heads, 3 KV heads) does not allow: said first, not after a torchrun launch
    code, out, err = run_main(monkeypatch, capsys, "generate", "--tp-size", "2", "--chat", "Hi", "--max-tokens", "2")
    assert code == 1 and "--tp-size 2 does not divide the target's attention heads (9), KV heads (3); use a --tp-size " \
        "that divides them: 1, 3" in err and "torchrun" not in err


def test_a_drafter_trained_for_another_target_warns_as_check_does(monkeypatch, capsys, tmp_path, smollm2_path,
                                                                   untrained_drafter):
    """serve said nothing when the drafter's training.json names another target; check and build warned."""
    import dflash_trt.serve.app as app_module
    from tests.cli.test_generate_cli import other_targets_drafter

    def stop(*args, **kwargs):  # the models are loaded and the warnings given: stop before serving
        raise SystemExit(0)

    monkeypatch.setattr(app_module, "create_app", stop)
    drafter, warning = other_targets_drafter(tmp_path, untrained_drafter)
    code, _, err = run_main(monkeypatch, capsys, "serve", "--port", "0", "--target", str(smollm2_path), "--drafter",
                            str(drafter))
    assert code == 0, err
    assert [line for line in err.splitlines() if line.startswith("warning: training target:")] == [warning]
