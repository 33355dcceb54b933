"""`dflash-trt serve --api-key`: the /v1 endpoints answer only requests carrying the key (real HTTP on 127.0.0.1,
the real `openai` client), a missing or wrong key is a 401 with OpenAI's error body before anything is generated,
and the probes and metrics stay open."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.test_openai_server import MODEL, live_server

KEY = "sk-test-3f9a"


@pytest.fixture(scope="module")
def keyed(smollm2_pipeline):
    with live_server(smollm2_pipeline, max_batch_size=2, api_key=KEY) as (base, app):
        yield base, app


def test_the_openai_client_needs_the_key(keyed):
    from openai import AuthenticationError, OpenAI

    base, _ = keyed
    good = OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    answer = good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert answer.usage.completion_tokens == 3
    assert good.responses.create(model=MODEL, input="Hi", max_output_tokens=2).usage.output_tokens == 2
    assert [m.id for m in good.models.list()] == [MODEL]
    bad = OpenAI(base_url=base + "/v1", api_key="sk-wrong", max_retries=0, timeout=120)
    with pytest.raises(AuthenticationError) as caught:
        bad.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    assert "wrong API key" in caught.value.message


@pytest.mark.parametrize("headers, why", [
    ({}, "carries no API key"),
    ({"Authorization": "Bearer " + KEY[:-1]}, "wrong API key"),
    ({"Authorization": "Basic " + KEY}, "wrong API key"),
    ({"Authorization": KEY}, "wrong API key"),
    ({"Authorization": "Bearer " + KEY + "x"}, "wrong API key"),
])
def test_a_missing_or_wrong_key_is_a_401(keyed, headers, why):
    base, app = keyed
    app.state.metrics.iteration_stats()  # read: each batch's entry is returned once
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, headers=headers)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert error["code"] == "invalid_api_key" and why in error["message"] and KEY not in error["message"]
    assert httpx.get(base + "/v1/models", headers=headers).status_code == 401
    assert app.state.metrics.iteration_stats() == []  # nothing was decoded for them


def test_the_scheme_is_case_insensitive_and_probes_stay_open(keyed):
    base, _ = keyed
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                   headers={"Authorization": "bearer " + KEY})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    for path in ("/health", "/version", "/metrics", "/perf_metrics", "/prometheus/metrics"):
        assert httpx.get(base + path).status_code == 200, path
