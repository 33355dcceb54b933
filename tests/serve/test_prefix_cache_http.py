"""`dflash-trt serve --enable-prefix-caching` over real HTTP with the real `openai` client: the next turn of a
conversation (chat, and Responses' previous_response_id) reuses the K/V of the turn before, says how many
tokens in OpenAI's usage details and vLLM's Prometheus counters, and answers the target's own greedy tokens."""

from __future__ import annotations

import httpx
import pytest

from dflash_trt.runtime.prefix_cache import PrefixCache
from tests.conftest import run_main
from tests.serve.test_openai_server import MODEL, ar_tokens, chat_ids, live_server, prometheus, sample

Q1 = [{"role": "user", "content": "Give me two tips for writing clear emails."}]


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_server_without_prefix_caching_reports_no_cache(server, client):
    """(First: the module's cached server shares the session's engine, whose prefix cache every server reads.)"""
    r = client.chat.completions.create(model=MODEL, messages=Q1, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details is None
    assert not [k for k in prometheus(server[0]) if k.startswith(("trtllm_prefix_cache", "trtllm_prompt_cached"))]
    raw = httpx.post(server[0] + "/v1/responses", json={"input": "Hi", "max_output_tokens": 2}).json()
    assert raw["usage"]["input_tokens_details"]["cached_tokens"] == 0


@pytest.fixture(scope="module")
def cached_server(smollm2_pipeline):
    """(base URL, the prefix cache, an openai client) of a live server whose engine keeps a 1 GiB prefix cache."""
    from openai import OpenAI

    eng = smollm2_pipeline.engine
    eng.prefix_cache = PrefixCache(1 << 30)
    try:
        with live_server(smollm2_pipeline, max_batch_size=4) as (base, _):
            yield base, eng.prefix_cache, OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        eng.prefix_cache = None


def uncached_reference(pipe, ids: list[int], max_tokens: int) -> list[int]:
    """The target's own greedy tokens (autoregressive), computed without the prefix cache (nothing counted or kept)."""
    eng = pipe.engine
    cache, eng.prefix_cache = eng.prefix_cache, None
    try:
        return ar_tokens(pipe, ids, max_tokens)[0]
    finally:
        eng.prefix_cache = cache


def held_tokens(pc: PrefixCache) -> list[list[int]]:
    return pc.sequences()


def test_the_next_chat_turn_reports_the_tokens_it_reused(cached_server, smollm2_pipeline):
    base, pc, client = cached_server
    pc.clear()
    before = prometheus(base)
    r1 = client.chat.completions.create(model=MODEL, messages=Q1, max_tokens=32, temperature=0)
    ids1 = chat_ids(smollm2_pipeline, Q1)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0 and r1.usage.prompt_tokens == len(ids1)
    [held] = held_tokens(pc)
    q2 = Q1 + [{"role": "assistant", "content": r1.choices[0].message.content},
               {"role": "user", "content": "Now make them shorter."}]
    r2 = client.chat.completions.create(model=MODEL, messages=q2, max_tokens=32, temperature=0)
    ids2 = chat_ids(smollm2_pipeline, q2)
    reused = shared(ids2[:-1], held)
    assert reused > len(ids1)  # the first prompt and most of its answer
    assert r2.usage.prompt_tokens_details.cached_tokens == reused and r2.usage.prompt_tokens == len(ids2)
    assert r2.choices[0].model_extra["metrics"]["cached_tokens"] == reused  # the runtime's per-choice metrics
    ref = uncached_reference(smollm2_pipeline, ids2, 32)  # the target's own greedy answer, without any cache
    assert r2.choices[0].message.content == smollm2_pipeline.decode(ref)
    after = prometheus(base)
    assert sample(after, "trtllm_prefix_cache_queries_total") - sample(before, "trtllm_prefix_cache_queries_total") \
        == len(ids1) + len(ids2)
    assert sample(after, "trtllm_prefix_cache_hits_total") - sample(before, "trtllm_prefix_cache_hits_total") == reused

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    # TensorRT-LLM's per-request counts of cached prompt tokens: 0 for the first turn, `reused` for the second
    assert delta("trtllm_prompt_cached_tokens_total") == reused
    assert delta("trtllm_prompt_cached_tokens_per_request_count") == 2
    assert delta("trtllm_prompt_cached_tokens_per_request_sum") == reused
    assert delta("trtllm_prompt_cached_tokens_per_request_bucket", le="0.0") == 1  # the first turn


def test_streamed_usage_and_n_choices_count_the_prompt_once(cached_server, smollm2_pipeline):
    base, pc, client = cached_server
    pc.clear()
    client.chat.completions.create(model=MODEL, messages=Q1, max_tokens=4, temperature=0)
    ids = chat_ids(smollm2_pipeline, Q1)
    stream = client.chat.completions.create(model=MODEL, messages=Q1, max_tokens=8, temperature=0, stream=True,
                                            n=2, stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens == len(ids)
    assert usage[0].prompt_tokens_details.cached_tokens == len(ids) - 1  # all but the last token, once


def test_a_request_for_prompt_logprobs_is_not_a_lookup(cached_server, smollm2_pipeline):
    """echo + logprobs needs every prompt position read: it reuses nothing and counts neither as a query nor a
    hit (the counters are the cache's own), while the same prompt without them reuses all but its last token."""
    base, pc, client = cached_server
    prompt = "The history of the Roman Empire begins"
    ids = smollm2_pipeline.encode(prompt)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    before = prometheus(base)
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    assert scored.choices[0].logprobs.tokens[: len(ids)] == [smollm2_pipeline.decode([t]) for t in ids]
    middle = prometheus(base)
    for name in ("trtllm_prefix_cache_queries_total", "trtllm_prefix_cache_hits_total"):
        assert sample(middle, name) == sample(before, name)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    after = prometheus(base)
    assert sample(after, "trtllm_prefix_cache_queries_total") - sample(middle, "trtllm_prefix_cache_queries_total") \
        == len(ids)
    assert sample(after, "trtllm_prefix_cache_hits_total") - sample(middle, "trtllm_prefix_cache_hits_total") \
        == len(ids) - 1


def test_a_responses_chain_reuses_the_previous_response(cached_server, smollm2_pipeline):
    from openai.types.responses import Response

    base, pc, client = cached_server
    pc.clear()
    first = client.responses.create(model=MODEL, input="Name a famous bridge.", max_output_tokens=24, temperature=0)
    assert first.usage.input_tokens_details.cached_tokens == 0
    [held] = held_tokens(pc)
    second = client.responses.create(model=MODEL, input="Where is it?", previous_response_id=first.id,
                                     max_output_tokens=24, temperature=0)
    Response.model_validate(second.model_dump())
    conversation = [{"role": "user", "content": "Name a famous bridge."},
                    {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Where is it?"}]
    ids = chat_ids(smollm2_pipeline, conversation)
    assert second.usage.input_tokens == len(ids)
    assert second.usage.input_tokens_details.cached_tokens == shared(ids[:-1], held) > 0
    ref = uncached_reference(smollm2_pipeline, ids, 24)
    assert second.output_text == smollm2_pipeline.decode(ref)


def test_the_serve_flags(monkeypatch, capsys):
    import dflash_trt.serve.app as app_module

    made = {}

    def capture(pipe, *args, **kwargs):  # the pipeline serve built: stop before serving it
        made["cache"] = pipe.engine.prefix_cache
        raise SystemExit(0)

    monkeypatch.setattr(app_module, "create_app", capture)
    code, _, err = run_main(monkeypatch, capsys, "serve", "--port", "0", "--enable-prefix-caching", "--prefix-cache-gb", "0.5")
    assert code == 0 and made["cache"].max_bytes == 2**29
    code, _, err = run_main(monkeypatch, capsys, "serve", "--port", "0", "--prefix-cache-gb", "2")
    assert code == 0 and made["cache"] is None
    assert "--prefix-cache-gb has no effect without --enable-prefix-caching" in err
    code, _, err = run_main(monkeypatch, capsys, "serve", "--port", "0", "--enable-prefix-caching", "--prefix-cache-gb", "0")
    assert code == 2 and "--prefix-cache-gb" in err
