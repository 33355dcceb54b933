"""The files in examples/ that the README's commands use run as the README shows them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import run_main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_the_prompts_file_gives_one_answer_per_line(monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "generate", "--prompts-file", str(EXAMPLES / "prompts.jsonl"),
                              "--max-tokens", "4", "--json", "--threads", "1")
    assert code == 0, err
    lines = (EXAMPLES / "prompts.jsonl").read_text().splitlines()
    results = [json.loads(line) for line in out.splitlines()]
    assert len(results) == len(lines) == 3 and all(len(r["token_ids"]) <= 4 for r in results)


def test_the_schema_gives_json_that_follows_it(monkeypatch, capsys):
    """The README's structured-output example: the answer parses and has the schema's fields and types."""
    code, out, err = run_main(monkeypatch, capsys, "generate", "--chat", "Describe Paris as JSON.", "--json-schema",
                              str(EXAMPLES / "schema.json"), "--max-tokens", "96", "--json", "--threads", "1")
    assert code == 0, err
    result = json.loads(out)
    assert result["finish_reason"] == "stop", result
    answer = json.loads(result["text"])
    assert set(answer) == {"city", "country", "landmarks"} and isinstance(answer["landmarks"], list)
    assert len(answer["landmarks"]) <= 3 and all(isinstance(x, str) for x in answer["landmarks"])


def test_the_client_example_talks_to_a_server(smollm2_pipeline):
    """examples/client.py against a live server: it finds the model name and gets a chat answer and a stream."""
    from tests.serve.test_openai_server import live_server

    with live_server(smollm2_pipeline) as (base, _):
        done = subprocess.run([sys.executable, str(EXAMPLES / "client.py"), base + "/v1"], capture_output=True,
                              text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()[:2]
    assert "Paris" in first and second.strip()


def test_the_client_example_says_what_to_do_without_a_server():
    """No server at the address: one line naming it and how to start one (it was an APIConnectionError traceback);
    --help is usage (it was taken as the URL)."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    done = subprocess.run([sys.executable, str(EXAMPLES / "client.py"), url], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert done.stderr == (f"error: no server answers at {url}; start one (dflash-trt serve --port 8000) or give its "
                           "address: python examples/client.py http://HOST:PORT/v1\n")
    usage = subprocess.run([sys.executable, str(EXAMPLES / "client.py"), "--help"], capture_output=True, text=True,
                           timeout=120)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: client.py [-h] [--api-key API_KEY] [base_url]")
