"""The server under GuideLLM (the vLLM project's load generator for OpenAI-compatible servers), run as a user runs
it against trtllm-serve or vLLM: streamed requests at a fixed concurrency, synthetic prompts of a set length,
`ignore_eos` and `stream_options` {include_usage, continuous_usage_stats}.

GuideLLM runs in a separate Python (`build_scripts/guidellm_venv.sh`; it pins its own dependencies), named by
GUIDELLM (its `guidellm` executable); without it these tests skip. Every request must succeed, and GuideLLM's
token counts (read from the server's `usage`) must equal what the server's Prometheus counters added."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.serve.test_openai_server import prometheus, sample

GUIDELLM = os.environ.get("GUIDELLM")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not GUIDELLM, reason="set GUIDELLM to a guidellm executable (build_scripts/guidellm_venv.sh) to load-test the "
                         "server with it")]

REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 4, 32, 16


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_load_test_succeeds_and_counts_what_the_server_counts(server, smollm2_path, tmp_path, route):
    base = server[0]
    before = prometheus(base)
    out = tmp_path / "guidellm.json"
    cmd = [GUIDELLM, "run", "--backend", f"kind=openai_http,target={base},request_format={route}",
           "--profile", "kind=concurrent,streams=2", "--constraint", f"kind=max_requests,count={REQUESTS}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=hf_auto,model={smollm2_path}", "--output", f"kind=json,path={out}",
           "--disable-console"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    [bench] = json.loads(out.read_text())["benchmarks"]
    assert bench["metrics"]["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                                  "total": REQUESTS}
    done = bench["requests"]["successful"]
    assert [r["output_metrics"]["text_tokens"] for r in done] == [OUTPUT_TOKENS] * REQUESTS  # ignore_eos honoured
    after = prometheus(base)

    def added(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert added("trtllm_request_success_total", finished_reason="length") == REQUESTS
    assert added("trtllm_generation_tokens_total") == REQUESTS * OUTPUT_TOKENS
    assert added("trtllm_prompt_tokens_total") == sum(r["input_metrics"]["text_tokens"] for r in done)
    for r in done:
        t = r["info"]["timings"]
        assert t["request_start"] <= t["first_token_iteration"] <= t["last_token_iteration"] <= t["request_end"]
