"""`dflash-trt serve --tp-size 2` under torchrun (gloo on this CPU): rank 0 answers over real HTTP while
rank 1 decodes every batch with it in lockstep (`dflash_trt.serve.lockstep`). Greedy answers are the
target's own greedy output; stop strings, seeded and unseeded sampling, a bad request and streaming all
keep the ranks together, logprobs included (a rank out of step would hang its collectives); Ctrl-C stops every process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.runtime.test_tensor_parallel import tiny_qwen3  # noqa: F401  (a fixture)
from tests.serve.test_openai_server import free_port
from tests.serve.test_serve_cli import wait_until_healthy

PROMPT = [1, 520, 3011, 44, 7]


def start_tp_server(target, drafter, *options) -> tuple[str, subprocess.Popen]:
    """`torchrun ... dflash-trt serve --tp-size 2` of the tiny target in a session of its own, healthy; returns its
    base URL and torchrun's process."""
    beside = Path(sys.executable).parent / "dflash-trt"
    exe = str(beside) if beside.is_file() else shutil.which("dflash-trt")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             str(free_port()), exe, "serve", "--tp-size", "2", "--target", str(target), "--drafter",
                             str(drafter), "--port", str(port), "--threads", "1", "--served-model-name", "tiny",
                             "--log-level", "warning", *options],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, base)
    return base, proc


@pytest.fixture(scope="module", params=[None, 2], ids=["whole-prefill", "chunked-prefill-prefix-caching"])
def tp_server(tiny_qwen3, request):  # noqa: F811
    """A torchrun server; its second instance reads prompts 2 tokens per step (chunked prefill in lockstep) and
    keeps a prefix cache on each rank (each its shard of the K/V, taking the same decisions)."""
    target, drafter = tiny_qwen3
    chunk = [] if request.param is None else ["--prefill-chunk-size", str(request.param), "--enable-prefix-caching"]
    base, proc = start_tp_server(target, drafter, *chunk)
    yield base, proc, target, drafter
    stop_tp_server(proc)  # when the Ctrl-C test did not stop it (deselected, or failed)


def stop_tp_server(proc: subprocess.Popen) -> None:
    """Stop `start_tp_server`'s torchrun and its ranks if still running."""
    if proc.poll() is None:
        # SIGINT first: torchrun forwards it to the ranks, which run in sessions of their own (a SIGKILL to
        # torchrun's group would leave them running, holding its pipes open)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)


def proc_args(server) -> list[str]:
    return server[1].args


def completion(base, **body):
    r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_answers_are_the_targets_and_ranks_stay_in_step(tp_server):
    from dflash_trt.api import load_pipeline
    from dflash_trt.runtime.sampling import SamplingParams

    base, _, target, drafter = tp_server
    one = load_pipeline(str(target), str(drafter))
    from dflash_trt.text import final_text

    [ref] = one.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True), mode="ar")
    text = final_text(ref.text, ref.finish_reason)
    greedy = completion(base, max_tokens=10, temperature=0, ignore_eos=True)
    assert greedy["choices"][0]["text"] == text  # the target's greedy output, as on one process (tests/runtime)
    stop = text[len(text) // 2:][:3]
    assert stop.strip()
    cut = completion(base, max_tokens=10, temperature=0, ignore_eos=True, stop=stop)["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[:text.index(stop)]
    seeded = [completion(base, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)["choices"][0]["text"]
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    unseeded = completion(base, max_tokens=8, temperature=1.0, n=2, ignore_eos=True)
    assert [c["metrics"]["completion_tokens"] for c in unseeded["choices"]] == [8, 8]
    bad = httpx.post(base + "/v1/completions", json={"prompt": [5, 10**9]}, timeout=60)
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    with httpx.stream("POST", base + "/v1/completions", timeout=120,
                      json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    again = completion(base, max_tokens=10, temperature=0, ignore_eos=True)
    assert again["choices"][0]["text"] == text
    # with prefix caching, PROMPT was read before: all of it but its last token is reused on both ranks
    cached = again["usage"].get("prompt_tokens_details", {"cached_tokens": None})["cached_tokens"]
    assert cached == (len(PROMPT) - 1 if "--enable-prefix-caching" in proc_args(tp_server) else None)
    # logprobs in lockstep (rank 1 gets them in its callbacks too): the single-process runtime's values
    [lp_ref] = one.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2), mode="ar")
    lps = completion(base, max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)["choices"][0]["logprobs"]
    assert lps["token_logprobs"] == pytest.approx([t.logprob for t in lp_ref.logprobs], abs=1e-4)


def test_a_request_joins_the_running_batch_on_every_rank(tp_server):
    """In-flight batching under lockstep: a short request sent while a long stream decodes joins its batch on
    both ranks (the add is broadcast), returns first, and both answers are the target's greedy output."""
    from dflash_trt.api import load_pipeline
    from dflash_trt.runtime.sampling import SamplingParams
    from dflash_trt.text import final_text

    base, _, target, drafter = tp_server
    one = load_pipeline(str(target), str(drafter))
    refs = [final_text(r.text, r.finish_reason) for r in
            one.generate([PROMPT, PROMPT[:3]], [SamplingParams(max_tokens=n, ignore_eos=True) for n in (200, 10)],
                         mode="ar")]
    started, got, order = threading.Event(), {}, []

    def long_stream():
        with httpx.stream("POST", base + "/v1/completions", timeout=120,
                          json={"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                                "stream": True}) as r:
            parts = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    parts.extend(c["text"] for c in json.loads(line[6:])["choices"])
                    started.set()
        got["long"] = "".join(parts)
        order.append("long")

    reader = threading.Thread(target=long_stream)
    reader.start()
    assert started.wait(60)
    r = httpx.post(base + "/v1/completions", timeout=120,
                   json={"prompt": PROMPT[:3], "max_tokens": 10, "temperature": 0, "ignore_eos": True})
    order.append("short")
    reader.join(120)
    assert order == ["short", "long"]
    assert r.json()["choices"][0]["text"] == refs[1] and got["long"] == refs[0]


def test_ctrl_c_stops_every_rank_even_mid_generation(tp_server):
    """Ctrl-C while a stream is being decoded: the followers stay until rank 0 has aborted it (a clean end
    of the stream, not a collective failing on a dead peer), then every process exits."""
    base, proc, _, _ = tp_server
    assert_stops_cleanly_mid_stream(base, proc, lambda: os.killpg(proc.pid, signal.SIGINT))  # as Ctrl-C in a terminal


def test_sigterm_to_torchrun_stops_every_rank_as_ctrl_c(tiny_qwen3):  # noqa: F811
    """SIGTERM to torchrun alone (kill, docker stop, systemd), which passes it on to every rank: the same clean
    abort of the running stream as Ctrl-C (a follower that died of it at once failed rank 0's collectives: the
    client got "generation failed: ... Connection reset by peer")."""
    base, proc = start_tp_server(*tiny_qwen3)
    try:
        assert_stops_cleanly_mid_stream(base, proc, lambda: proc.send_signal(signal.SIGTERM))
    finally:
        stop_tp_server(proc)


def assert_stops_cleanly_mid_stream(base, proc, stop) -> None:
    """Start a long stream on the server of torchrun `proc`, call `stop()` once it streams, and check that the
    stream ends with an "abort" finish and [DONE], every process exits without a rank's traceback, and the port
    is closed."""
    body = {"prompt": PROMPT, "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True, "n": 4}
    seen: list[str] = []

    def stream():
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    seen.append(line)
        except httpx.TransportError:
            seen.append("transport error")

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.time() + 120
    while not any(line.startswith("data: {") for line in seen):
        assert time.time() < deadline, "the stream did not start"
        time.sleep(0.05)
    stop()
    try:
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("a rank did not stop")
    reader.join(30)
    text = "\n".join(seen)
    assert "generation failed" not in text and "by peer" not in text, text[-2000:]  # gloo: connection closed / reset
    assert [line for line in seen if line][-1] == "data: [DONE]" and '"finish_reason":"abort"' in text.replace(" ", ""), text[-2000:]
    assert "Exception in ASGI application" not in err and "lockstep" not in err, err[-3000:]  # no traceback
    with pytest.raises(httpx.TransportError):
        httpx.get(base + "/health", timeout=2)
