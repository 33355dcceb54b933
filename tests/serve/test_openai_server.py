"""The OpenAI-compatible server over real HTTP on 127.0.0.1 (uvicorn), driven by the real `openai` client
and httpx, serving SmolLM2-135M-Instruct with the default drafter. Greedy answers are checked token for
token against the runtime's autoregressive output; metrics by exact counts."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.training.prompts import encode_prompt

MODEL = "smollm2-test"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(pipe, **options):
    """(base URL, app) of `create_app(pipe, MODEL, **options)` served by uvicorn on a free port, until exit."""
    import uvicorn

    from dflash_trt.serve.app import create_app

    app = create_app(pipe, MODEL, **options)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


def ar_tokens(pipe, ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    """The target's own greedy completion (autoregressive mode): token ids and finish reason."""
    [res] = pipe.generate([ids], SamplingParams(max_tokens=max_tokens), mode="ar")
    return res.token_ids, res.finish_reason


def chat_ids(pipe, messages) -> list[int]:
    return encode_prompt(pipe.tokenizer, messages)


def prometheus(base: str) -> dict[str, float]:
    """Every sample of /prometheus/metrics: 'name{labels}' -> value."""
    out = {}
    for line in httpx.get(base + "/prometheus/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def sample(metrics: dict[str, float], name: str, **labels) -> float:
    """The value of metric `name` whose labels include `labels` (0.0 when absent)."""
    for key, value in metrics.items():
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    return 0.0


def aborted_then_serving(base: str, before: float, client) -> None:
    """Wait (60 s at most) until the abort counter passes `before`, then check a new request is answered."""
    deadline = time.time() + 60
    while sample(prometheus(base), "trtllm_request_success_total", finished_reason="cancelled") == before:
        assert time.time() < deadline, "the abandoned request was not aborted"
        time.sleep(0.2)
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_chat_greedy_is_the_targets_output(client, smollm2_pipeline):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    ids = chat_ids(smollm2_pipeline, QUESTION)
    ref, reason = ar_tokens(smollm2_pipeline, ids, 40)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == smollm2_pipeline.decode(ref)
    assert choice.finish_reason == reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), len(ref), len(ids) + len(ref))
    assert r.usage.completion_tokens_details is None  # (reasoning_tokens only with a --reasoning-parser)
    assert r.model == MODEL and r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    m = choice.model_extra["metrics"]
    assert m["completion_tokens"] == len(ref) and m["drafted_tokens"] > 0  # speculative, not the ar path
    assert m["verify_steps"] < len(ref) - 1  # the drafter was accepted at least once


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": ""}],  # a chat UI's empty message
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  "}],
    [{"role": "system", "content": "Greet the user."}],  # a system prompt alone
])
def test_a_conversation_without_user_text_is_answered(client, smollm2_pipeline, messages):
    """OpenAI's API and vLLM answer any conversation; this server refused these with a 400 ("no user message with
    text", the prompts-file rule). Greedy: the target's own tokens for the templated conversation."""
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    ids = chat_ids(smollm2_pipeline, messages)
    ref, reason = ar_tokens(smollm2_pipeline, ids, 8)
    assert r.choices[0].message.content == smollm2_pipeline.decode(ref) and r.choices[0].finish_reason == reason
    assert r.usage.prompt_tokens == len(ids)


def test_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_continuous_usage_stats_count_each_choices_tokens_so_far(client, smollm2_pipeline):
    """stream_options.continuous_usage_stats (vLLM's and trtllm-serve's; GuideLLM sends it): every choice chunk
    carries its prompt's tokens and the tokens generated so far, whose text holds what was streamed; the closing
    chunk has the choice's total. include_usage left out is true, as in vLLM and trtllm-serve (TensorRT-LLM
    tensorrt_llm/serve/openai_protocol.py StreamOptions): continuous_usage_stats alone gives the usage too."""
    pipe = smollm2_pipeline
    prompts = ["def fibonacci(n):", "The three primary colors are"]
    ids = [pipe.encode(p) for p in prompts]
    refs = [ar_tokens(pipe, x, 16)[0] for x in ids]
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=16, temperature=0, stream=True,
                                            stream_options=options))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(len(r) for r in refs)
    text, counts = ["", ""], [[], []]
    for c in chunks[:-1]:
        i, u = c.choices[0].index, c.usage
        text[i] += c.choices[0].text
        counts[i].append(u.completion_tokens)
        assert (u.prompt_tokens, u.total_tokens) == (len(ids[i]), len(ids[i]) + u.completion_tokens)
        assert pipe.decode(refs[i][:u.completion_tokens]).startswith(text[i])  # the counted tokens hold the text
    for i in (0, 1):
        assert text[i] == pipe.decode(refs[i]) and counts[i] == sorted(counts[i]) and counts[i][-1] == len(refs[i])
        assert len(counts[i]) > 2  # streamed in several chunks, each counted
    chat = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, stream=True,
                                               stream_options=options))
    n_prompt = len(chat_ids(pipe, QUESTION))
    assert chat[0].choices[0].delta.role == "assistant" and (chat[0].usage.prompt_tokens, chat[0].usage.completion_tokens) \
        == (n_prompt, 0)
    assert [c.usage.completion_tokens for c in chat if c.choices][-1] == chat[-1].usage.completion_tokens
    alone = list(client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=4, temperature=0, stream=True,
                                           stream_options={"continuous_usage_stats": True}))
    assert alone[-1].choices == [] and alone[-1].usage.completion_tokens == 4
    assert [c.usage.completion_tokens for c in alone if c.choices][-1] == 4
    assert all(c.usage.prompt_tokens == len(ids[0]) for c in alone)
    off = list(client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=4, temperature=0, stream=True,
                                         stream_options={"include_usage": True, "continuous_usage_stats": None}))
    assert all(c.usage is None for c in off[:-1]) and off[-1].usage.completion_tokens == 4  # null: off, as vLLM reads it


def test_stream_options_include_usage_defaults_to_true(client, server):
    """As trtllm-serve reads stream_options (TensorRT-LLM tensorrt_llm/serve/openai_protocol.py: StreamOptions'
    include_usage defaults to True; postprocess_handlers.py adds the usage chunk when it is true) and as vLLM does:
    `{}` gives the usage chunk, `{"include_usage": null}` none; and `{}` without stream is taken (their check refuses
    only stream_options that hold something), while a set field without stream stays a 400."""
    kwargs = dict(model=MODEL, prompt="The three primary colors are", max_tokens=5, temperature=0, stream=True)
    empty = list(client.completions.create(**kwargs, stream_options={}))
    assert empty[-1].choices == [] and empty[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in empty[:-1])
    chat = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, stream=True,
                                               stream_options={}))
    assert chat[-1].choices == [] and (chat[-1].usage.completion_tokens, chat[-1].usage.total_tokens) == \
        (3, chat[-1].usage.prompt_tokens + 3)
    off = list(client.completions.create(**kwargs, stream_options={"include_usage": None}))
    assert all(c.choices and c.usage is None for c in off)
    base = server[0]
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream_options": {}}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                   "stream_options": {"include_usage": True}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


#: trtllm-serve's request fields at their defaults (TensorRT-LLM tensorrt_llm/serve/openai_protocol.py,
#: CompletionRequest / ChatCompletionRequest), as a client built for it may send them
TRTLLM_FIELDS = {"spaces_between_special_tokens": True, "detokenize": True, "return_context_logits": False,
                 "top_p_min": 0.0, "early_stopping": None, "truncate_prompt_tokens": None, "lora_request": None,
                 "disaggregated_params": None, "thinking_token_budget": None, "priority": 0.5, "cache_salt": "tenant-1"}


def test_trtllm_serve_fields_at_their_defaults_are_taken(server, smollm2_pipeline):
    """trtllm-serve takes these fields (TensorRT-LLM tensorrt_llm/serve/openai_protocol.py); at their defaults they
    change nothing here, so they are taken and the answer is the same greedy one; another value is a 400 naming the
    field (this server does not do it), and an out-of-range priority one as trtllm-serve's [0, 1]."""
    base, pipe = server[0], smollm2_pipeline
    ids = pipe.encode("The three primary colors are")
    ref, _ = ar_tokens(pipe, ids, 6)
    r = httpx.post(base + "/v1/completions", json={"prompt": "The three primary colors are", "max_tokens": 6,
                                                   "temperature": 0, "add_special_tokens": True, **TRTLLM_FIELDS},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == pipe.decode(ref) and r.json()["usage"]["completion_tokens"] == len(ref)
    chat_ref, _ = ar_tokens(pipe, chat_ids(pipe, QUESTION), 4)
    r = httpx.post(base + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4, "temperature": 0,
                                                        "add_special_tokens": False, "add_generation_prompt": True,
                                                        "documents": None, "chat_template": None, **TRTLLM_FIELDS},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == pipe.decode(chat_ref)
    for path, field, value in (("/v1/completions", "add_special_tokens", False),
                               ("/v1/chat/completions", "add_special_tokens", True),
                               ("/v1/chat/completions", "add_generation_prompt", False),
                               ("/v1/chat/completions", "chat_template", "{{ messages }}"),
                               ("/v1/completions", "detokenize", False), ("/v1/completions", "top_p_min", 0.5),
                               ("/v1/completions", "truncate_prompt_tokens", 8),
                               ("/v1/completions", "lora_request", {"lora_name": "a", "lora_int_id": 1,
                                                                    "lora_path": "/x"})):
        body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": QUESTION}
        r = httpx.post(base + path, json={**body, "max_tokens": 2, field: value}, timeout=60)
        err = r.json()["error"]
        assert (r.status_code, err["param"]) == (400, field) and "not supported" in err["message"], (field, r.text)
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "priority": 1.5}, timeout=60)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "priority")


def test_completions_batch_n_and_token_ids(client, smollm2_pipeline):
    pipe = smollm2_pipeline
    prompts = ["def fibonacci(n):", "The three primary colors are"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    ids = [pipe.encode(p) for p in prompts]
    for i, c in enumerate(r.choices):
        ref, reason = ar_tokens(pipe, ids[i // 2], 12)
        assert c.text == pipe.decode(ref) and c.finish_reason == reason
    assert r.usage.prompt_tokens == sum(len(x) for x in ids)
    assert r.usage.completion_tokens == sum(c.model_extra["metrics"]["completion_tokens"] for c in r.choices)
    by_ids = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    default = client.completions.create(model=MODEL, prompt=prompts[1], temperature=0)  # OpenAI's max_tokens 16
    assert default.usage.completion_tokens == 16 and default.choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text_streamed_or_not(client, smollm2_pipeline):
    pipe = smollm2_pipeline
    ref, _ = ar_tokens(pipe, chat_ids(pipe, QUESTION), 40)
    full = pipe.decode(ref)
    stop = "of Fr"  # spans two tokens (" of", " France"): the stream must hold back " of" until it knows
    assert stop in full
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, stop=[stop, "zzz"])
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop  # vLLM's, trtllm-serve's
    streamed = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == r.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == "stop" and streamed[-1].choices[0].stop_reason == stop


def test_seeded_sampling_reproducible_and_as_the_runtime(client, smollm2_pipeline):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0.9, top_p=0.95, seed=11)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    [ref] = smollm2_pipeline.generate([chat_ids(smollm2_pipeline, QUESTION)],
                                      SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=11))
    assert a.choices[0].message.content == ref.text
    two = client.chat.completions.create(**kwargs, n=2)  # choice j samples with seed + j
    assert two.choices[0].message.content == ref.text
    [ref1] = smollm2_pipeline.generate([chat_ids(smollm2_pipeline, QUESTION)],
                                       SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=12))
    assert two.choices[1].message.content == ref1.text


BAD = [
    ({"messages": QUESTION, "temperature": "hot"}, 400, "temperature"),
    ({"messages": QUESTION, "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ({"messages": QUESTION, "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ({"messages": QUESTION, "max_completion_tokens": -3}, 400, "max_completion_tokens must be >= 1, got -3"),
    ({"messages": QUESTION, "max_tokens": 100000}, 400, "ask for at most"),
    ({"messages": QUESTION, "model": "gpt-4"}, 404, "'gpt-4' does not exist"),
    ({"messages": QUESTION, "presence_penalty": 2.5}, 400, "presence_penalty must be in [-2, 2]"),
    ({"messages": QUESTION, "best_of": 2}, 400, "best_of=2 is not supported"),
    ({"messages": QUESTION, "n": 0}, 400, "n must be >= 1"),
    ({"messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ({"messages": QUESTION, "stop": [""]}, 400, "empty string"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role 'wizard'"),
    ({"messages": []}, 400, "messages is an empty list"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, 400, "surrogate"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "image_url"),
    ({}, 400, "messages: Field required"),
    ({"messages": QUESTION, "temprature": 0}, 400, "temprature: Extra inputs are not permitted (got 0); did you mean "
                                                    "temperature?"),
    ({"messages": QUESTION, "max_new_tokens": 8}, 400, "max_new_tokens: Extra inputs are not permitted (got 8); use "
                                                     "max_tokens"),
    ({"messages": QUESTION, "include_stop_str_in_output": True}, 400, "include_stop_str_in_output=True is not "
     "supported by this server (DFlash runtime); leave it out (the text ends before the stop string"),
    ({"messages": QUESTION, "skip_special_tokens": False}, 400, "special tokens are always left out of the text"),
    ({"messages": QUESTION, "stream_options": {"include_usage": True}}, 400, "only allowed with stream: true"),
    ({"messages": QUESTION, "ignore_eos": "yes"}, 400, "ignore_eos: Input should be a valid boolean"),
    ({"messages": QUESTION, "stop_token_ids": [99999999]}, 400, "stop_token_ids holds 99999999, outside the vocabulary"),
    ({"messages": QUESTION, "min_p": 1.5}, 400, "min_p must be in [0, 1]"),
    ({"messages": QUESTION, "functions": [{"name": "f"}]}, 400, "functions="),
    ({"messages": QUESTION, "seed": 2**64}, 400, "got 18446744073709551616"),  # the seed sent, not wrapped
    ({"messages": QUESTION, "seed": 10**20}, 400, "[-2**63, 2**64), got 100000000000000000000"),
]

#: bodies whose error is about one field: (endpoint, body, that field as OpenAI's `param`)
PARAMS = [
    ("completions", {"prompt": "hello " * 9000}, "prompt"),
    ("completions", {"prompt": ["hi", "hello " * 9000]}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hello " * 9000}]}, "messages"),
    ("completions", {"prompt": "hi", "max_tokens": 9000}, "max_tokens"),
    ("chat/completions", {"messages": QUESTION, "max_tokens": 100000}, "max_tokens"),
    ("chat/completions", {"messages": QUESTION, "max_completion_tokens": 100000}, "max_completion_tokens"),
    ("chat/completions", {"messages": QUESTION, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"messages": QUESTION, "max_tokens": -3}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("chat/completions", {"messages": QUESTION, "seed": 2**64}, "seed"),
    ("chat/completions", {"messages": QUESTION, "stop": [""]}, "stop"),
]


def read_response(sock: socket.socket) -> str:
    """One HTTP/1.1 response read from `sock`: its head, then as many body bytes as its Content-Length says
    (they may come in later packets), or until the server closes."""
    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if length is not None and len(body) >= length:
                break
        try:
            part = sock.recv(65536)
        except ConnectionResetError:
            break
        if not part:
            break
        data += part
    return data.decode(errors="replace")


@pytest.mark.parametrize("field, value, low, high", [
    ("temperature", 2.5, 0, 2), ("temperature", -0.1, 0, 2), ("top_p", 1.5, 0, 1),
    ("presence_penalty", -2.5, -2, 2), ("frequency_penalty", 3.0, -2, 2)])
def test_sampling_fields_outside_openais_ranges_are_a_400(client, field, value, low, high):
    """OpenAI's ranges are the HTTP API's, on all three endpoints (the runtime would sample at temperature 2.5):
    a 400 whose `param` is the field and whose message gives the range and the value."""
    import openai

    want = f"{field} must be in [{low}, {high}] (OpenAI's range), got {value}"
    calls = [lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, **{field: value}),
             lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, **{field: value})]
    if field in ("temperature", "top_p"):  # the Responses API's sampling fields
        calls.append(lambda: client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, **{field: value}))
    for call in calls:
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.status_code == 400 and err.value.body["param"] == field
        assert err.value.body["message"] == want
    edge = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, seed=1, **{field: high})
    assert edge.usage.completion_tokens == 2  # the range's end is in it


def test_bad_requests_get_a_clear_error_and_the_server_keeps_serving(server, client):
    base = server[0]
    for body, status, words in BAD:
        r = httpx.post(base + "/v1/chat/completions", content=json.dumps(body),  # ASCII JSON: a lone surrogate as its escape
                       headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        assert words in r.json()["error"]["message"], (body, r.text)
    for endpoint, body, param in PARAMS:
        r = httpx.post(f"{base}/v1/{endpoint}", content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text[:300])
    r = httpx.post(base + "/v1/chat/completions", json={"messages": QUESTION, "max_completion_tokens": 100000})
    assert "max_completion_tokens is 100000" in r.json()["error"]["message"]  # the name the client used
    deep = b'{"prompt": "hi", "user": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    r = httpx.post(base + "/v1/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
    long_prompt = "hello " * 9000  # more tokens than SmolLM2's 8192-token context
    r = httpx.post(base + "/v1/completions", json={"prompt": long_prompt})
    assert r.status_code == 400 and "shorten it to at most 8191" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", json={"prompt": [5, 10**9]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    for prompt, found in ((["a", [1, 2]], "a list mixing a list of token ids and a string"),
                          ([1.5], "an element 1.5"), ([[1, True]], "an element [1, true]"), (None, "null")):
        r = httpx.post(base + "/v1/completions", json={"prompt": prompt})  # one message, not one per union member
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "invalid request: prompt: must be a string, a list of strings, a list of token ids (integers) or "
                       f"a list of lists of token ids; got {found}", "type": "invalid_request_error", "param": "prompt",
            "code": None}, r.text
    r = httpx.post(base + "/v1/completions", content=b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}",
                   headers={"content-type": "application/json"})  # valid JSON, past Python's int digits limit
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "the body holds an integer of more digits than Python reads (4300); no field takes one that long: send each "
        "number within its field's range"), r.text
    r = httpx.post(base + "/v1/completions", content=b'{"prompt": "hi",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] is None  # not the character position
    r = httpx.post(base + "/v1/completions", content=b"hello")
    assert r.status_code == 400 and "not a JSON object" in r.json()["error"]["message"]
    for endpoint, example in (("completions", '{"prompt": "Hi"'), ("chat/completions", '{"messages": [')):
        r = httpx.post(f"{base}/v1/{endpoint}", json=[1])  # JSON, not an object: the example fits the endpoint
        assert r.status_code == 400 and f"such as {example}" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = httpx.post(base + "/v1/completions", json={"prompt": [True, 5]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(base + "/v1/chat/completions", json={"messages": QUESTION, "top_p": 0})
    assert r.json()["error"]["param"] == "top_p"
    r = httpx.post(base + "/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "could not be parsed" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", json={"prompt": "x" * (17 * 2**20)})
    assert r.status_code == 413 and "over this server's limit" in r.json()["error"]["message"]

    def chunked(data: bytes, size: int = 2**20):  # a generator body: chunked transfer encoding, no Content-Length
        for i in range(0, len(data), size):
            yield data[i:i + size]

    r = httpx.post(base + "/v1/completions", content=chunked(b'{"prompt": "' + b"x" * (17 * 2**20) + b'"}'),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "passed this server's limit of 16777216 bytes" in r.json()["error"]["message"]
    # a small Content-Length beside Transfer-Encoding: chunked: the server reads the chunks, so they are counted
    with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(20):
                sock.sendall(b"100000\r\n" + b"x" * 2**20 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the rest
        reply = read_response(sock)
    assert reply.startswith("HTTP/1.1 413") and "passed this server's limit" in reply, reply[:300]
    r = httpx.post(base + "/v1/completions", content=chunked(json.dumps({"prompt": "hi", "max_tokens": 3}).encode(), 5),
                   headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    top = {"prompt": "hi", "max_tokens": 2, "n": 2, "seed": 2**64 - 1, "temperature": 1}  # choice 1: seed wrapped
    texts = []
    for _ in range(2):
        r = httpx.post(base + "/v1/completions", json=top)
        assert r.status_code == 200, r.text
        texts.append([c["text"] for c in r.json()["choices"]])
    assert texts[0] == texts[1]  # reproducible
    r = httpx.get(base + "/v1/nothing")
    assert r.status_code == 404 and "no endpoint GET /v1/nothing" in r.json()["error"]["message"]
    r = httpx.get(base + "/v1/chat/completions")
    assert r.status_code == 405 and "GET is not allowed" in r.json()["error"]["message"]
    assert r.headers["allow"] == "POST" and "use POST" in r.json()["error"]["message"]  # RFC 9110: a 405 names them
    r404 = httpx.post(base + "/v1/chat/completions", json={"messages": QUESTION, "model": "gpt-4"})
    r413 = httpx.post(base + "/v1/completions", content=b"x" * (17 * 2**20))
    codes = [x.json()["error"]["code"] for x in (r, r404, r413, httpx.post(base + "/v1/completions", content=b"{"))]
    assert codes == [None, "model_not_found", None, None]  # OpenAI's: a string or null, never the HTTP status
    ok = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, user="someone",
                                        extra_body={"top_k": -1})  # vLLM's top_k -1 = off; user ignored
    assert ok.usage.completion_tokens == 4


def test_concurrent_requests_batch_together_with_the_same_answers(server, smollm2_pipeline):
    base, app = server
    deadline = time.time() + 60
    while not app.state.scheduler.idle:  # an earlier test's aborted request, its last iteration recorded
        assert time.time() < deadline, "the server did not become idle"
        time.sleep(0.05)
    app.state.metrics.iteration_stats()  # forget earlier iterations
    questions = ["Name a planet.", "Name a color.", "Name an animal."]
    answers, tokens, prompt_tokens = {}, {}, {}

    def ask(q):
        r = httpx.post(base + "/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": q}], "max_tokens": 16, "temperature": 0})
        answers[q] = r.json()["choices"][0]["message"]["content"]
        tokens[q] = r.json()["usage"]["completion_tokens"]
        prompt_tokens[q] = r.json()["usage"]["prompt_tokens"]

    threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for q in questions:
        ref, _ = ar_tokens(smollm2_pipeline, chat_ids(smollm2_pipeline, [{"role": "user", "content": q}]), 16)
        assert answers[q] == smollm2_pipeline.decode(ref)
    stats = httpx.get(base + "/metrics").json()  # one entry per decode step of the in-flight batch
    assert all(1 <= s["numActiveRequests"] <= 3 for s in stats)
    assert max(s["numActiveRequests"] for s in stats) >= 2  # they arrive within ms, a 16-token answer takes longer
    emitted = sum(s["specDecodingStats"]["acceptanceLength"] * s["inflightBatchingStats"]["numGenRequests"]
                  for s in stats)
    assert round(emitted) == sum(tokens.values()) - 3  # every token but each first one (the prefill's)
    assert [s["iter"] for s in stats] == list(range(stats[0]["iter"], stats[0]["iter"] + len(stats)))
    batching = [s["inflightBatchingStats"] for s in stats]
    assert [b["numGenRequests"] for b in batching] == [s["numActiveRequests"] for s in stats]
    assert sum(b["numCtxTokens"] for b in batching) == sum(prompt_tokens.values())  # each prompt read once
    assert sum(b["numContextRequests"] for b in batching) == 3
    # TensorRT-LLM's other IterationStats fields: each of the 3 sequences completes in exactly one iteration, the
    # batch's bound, this process's memory, the mean tokens a decoded sequence got in the step, the local time
    assert sum(s["numCompletedRequests"] for s in stats) == 3 and stats[-1]["numCompletedRequests"] >= 1
    assert {s["maxNumActiveRequests"] for s in stats} == {app.state.scheduler.max_batch_size}
    assert all(s["gpuMemUsage"] == 0 and s["pinnedMemUsage"] == 0 and s["cpuMemUsage"] > 100 * 2**20 for s in stats)
    assert all(b["avgNumDecodedTokensPerIter"] == s["specDecodingStats"]["acceptanceLength"]
               for s, b in zip(stats, batching) if b["numGenRequests"])
    stamps = [datetime.datetime.strptime(s["timestamp"], "%m-%d-%Y %H:%M:%S.%f") for s in stats]
    assert stamps == sorted(stamps) and abs(datetime.datetime.now() - stamps[-1]) < datetime.timedelta(minutes=5)
    assert httpx.get(base + "/metrics").json() == []  # each iteration is returned once


def test_chunked_prefill_reads_a_long_prompt_while_a_stream_goes_on(smollm2_pipeline):
    """`--prefill-chunk-size 16` over real HTTP: a long prompt arriving while a greedy stream runs is read 16
    tokens per decode step, the stream gets tokens during those steps, and both answers are the target's
    greedy output; the iteration stats count every prompt token once, at most 16 per iteration."""
    text = " ".join(f"item {i}: a small red box;" for i in range(30))
    long_q = [{"role": "user", "content": f"Here is a list. {text} How many items are there?"}]
    long_ids = chat_ids(smollm2_pipeline, long_q)
    assert len(long_ids) > 200
    with live_server(smollm2_pipeline, max_batch_size=4, prefill_chunk=16) as (base, app):
        got = {}

        def ask_long():
            r = httpx.post(base + "/v1/chat/completions", timeout=300,
                           json={"messages": long_q, "max_tokens": 4, "temperature": 0})
            got["long"] = r.json()

        asker = threading.Thread(target=ask_long)
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=300,
                          json={"messages": QUESTION, "max_tokens": 64, "temperature": 0, "stream": True,
                                "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
            parts = []
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    parts.append(chunk["choices"][0]["delta"]["content"])
                    if not asker.is_alive() and "long" not in got:
                        asker.start()
                if chunk.get("usage"):
                    got["stream_usage"] = chunk["usage"]
        asker.join()
        stats = httpx.get(base + "/metrics").json()
    [ref] = smollm2_pipeline.generate([chat_ids(smollm2_pipeline, QUESTION)],
                                      SamplingParams(max_tokens=64, ignore_eos=True), mode="ar")
    assert "".join(parts) == smollm2_pipeline.decode(ref.token_ids) and got["stream_usage"]["completion_tokens"] == 64
    long_ref, _ = ar_tokens(smollm2_pipeline, long_ids, 4)
    assert got["long"]["choices"][0]["message"]["content"] == smollm2_pipeline.decode(long_ref)
    batching = [s["inflightBatchingStats"] for s in stats]
    assert sum(b["numCtxTokens"] for b in batching) == len(long_ids) + got["stream_usage"]["prompt_tokens"]
    assert max(b["numCtxTokens"] for b in batching) == 16
    # the long prompt's chunks: read in iterations where the stream decoded too (its 64 tokens take more steps)
    reading = [s for s in stats if s["inflightBatchingStats"]["numCtxTokens"]
               and s["inflightBatchingStats"]["numScheduledRequests"] == 2]
    assert len(reading) >= len(long_ids) // 16 - 1
    # numActiveRequests counts the long request from its first chunk on, as TensorRT-LLM counts requests in
    # their context phase: 2 in each of those iterations, also before it decodes (numGenRequests 1)
    assert all(s["numActiveRequests"] == 2 for s in reading)
    before_joining = [s for s in reading if s["inflightBatchingStats"]["numGenRequests"] == 1]
    assert len(before_joining) >= len(long_ids) // 16 - 1
    assert sum(s["numCompletedRequests"] for s in stats) == 2 and {s["maxNumActiveRequests"] for s in stats} == {4}


def wait_idle(app) -> None:
    """Wait (60 s at most) until the server's scheduler is idle: every iteration recorded, every result out."""
    deadline = time.time() + 60
    while not app.state.scheduler.idle:
        assert time.time() < deadline, "the scheduler did not go idle"
        time.sleep(0.02)


def test_prometheus_counts_match_the_responses(server, client):
    base, app = server
    wait_idle(app)
    httpx.get(base + "/metrics")  # the iterations so far
    before = prometheus(base)
    r1 = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    r2 = client.completions.create(model=MODEL, prompt=["def add(a, b):", "Once upon a time"], max_tokens=8,
                                   temperature=0)
    wait_idle(app)
    after = prometheus(base)
    iters = httpx.get(base + "/metrics").json()

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    choices = [*r1.choices, *r2.choices]
    reasons = [c.finish_reason for c in choices]
    for reason in ("stop", "length"):
        assert delta("trtllm_request_success_total", finished_reason=reason, model_name=MODEL) == reasons.count(reason)
    assert delta("trtllm_prompt_tokens_total") == r1.usage.prompt_tokens + r2.usage.prompt_tokens
    assert delta("trtllm_generation_tokens_total") == r1.usage.completion_tokens + r2.usage.completion_tokens
    metrics = [c.model_extra["metrics"] for c in choices]
    assert delta("trtllm_spec_decode_num_draft_tokens_total") == sum(m["drafted_tokens"] for m in metrics)
    assert delta("trtllm_spec_decode_num_accepted_tokens_total") == sum(m["accepted_tokens"] for m in metrics)
    assert delta("trtllm_spec_decode_num_verify_steps_total") == sum(m["verify_steps"] for m in metrics)
    # per draft position (TensorRT-LLM's names and label): the choices' own counts, position 0 the first draft
    k = len(metrics[0]["drafted_per_position"])
    for name, field in (("trtllm_spec_decode_drafted_tokens_total", "drafted_per_position"),
                        ("trtllm_spec_decode_accepted_tokens_total", "accepted_per_position")):
        got = [delta(name, token_position=pos) for pos in range(k + 1)]
        assert got == [sum(m[field][pos] for m in metrics) for pos in range(k)] + [0], name
    assert sum(delta("trtllm_spec_decode_drafted_tokens_total", token_position=pos) for pos in range(k)) == \
        sum(m["drafted_tokens"] for m in metrics) > 0
    assert delta("trtllm_e2e_request_latency_seconds_count") == 3
    assert delta("trtllm_time_to_first_token_seconds_count") == 3
    # TensorRT-LLM's phases, from each choice's own times: prefill (scheduled -> first token), decode (first -> last
    # token), inference (scheduled -> last token); queue + inference = e2e
    assert delta("trtllm_request_prefill_time_seconds_count") == 3
    assert delta("trtllm_request_prefill_time_seconds_sum") == pytest.approx(
        sum(m["time_to_first_token_s"] for m in metrics))
    decoded = [m for m in metrics if m["completion_tokens"] > 1]
    assert delta("trtllm_request_decode_time_seconds_count") == len(decoded) > 0
    assert delta("trtllm_request_decode_time_seconds_sum") == pytest.approx(
        sum(m["total_time_s"] - m["time_to_first_token_s"] for m in decoded))
    assert delta("trtllm_request_inference_time_seconds_sum") == pytest.approx(sum(m["total_time_s"] for m in metrics))
    assert delta("trtllm_e2e_request_latency_seconds_sum") == pytest.approx(
        sum(m["total_time_s"] + m["queue_time_s"] for m in metrics))
    # trtllm-serve's buckets (its MetricsCollector's defaults)
    for name, top in (("trtllm_e2e_request_latency_seconds", "7680.0"), ("trtllm_time_to_first_token_seconds", "2560.0"),
                      ("trtllm_time_per_output_token_seconds", "80.0"), ("trtllm_request_prefill_time_seconds", "2560.0")):
        assert sample(after, name + "_bucket", le=top) == sample(after, name + "_count") > 0
    # the iterations' metrics: each GET /metrics entry counted, the gauges at the last one
    assert delta("trtllm_num_requests_completed_total") == sum(i["numCompletedRequests"] for i in iters) == 3
    read = [i["inflightBatchingStats"]["numCtxTokens"] for i in iters if i["inflightBatchingStats"]["numCtxTokens"]]
    assert delta("trtllm_prefill_batch_tokens_count") == len(read) >= 2
    assert delta("trtllm_prefill_batch_tokens_sum") == sum(read) == r1.usage.prompt_tokens + r2.usage.prompt_tokens
    last = iters[-1]
    assert sample(after, "trtllm_iteration_latency_seconds") == pytest.approx(last["iterLatencyMS"] / 1000)
    assert sample(after, "trtllm_num_generation_requests") == last["inflightBatchingStats"]["numGenRequests"]
    assert sample(after, "trtllm_num_context_requests") == last["inflightBatchingStats"]["numContextRequests"]
    assert sample(after, "trtllm_spec_decode_acceptance_length") == last["specDecodingStats"]["acceptanceLength"]
    assert sample(after, "trtllm_max_num_active_requests") == last["maxNumActiveRequests"] == 4
    assert sample(after, "trtllm_cpu_memory_usage_bytes") > 0
    assert "trtllm_gpu_memory_usage_bytes" not in {k.split("{")[0] for k in after}  # on the CPU: nothing measured
    assert sample(after, "trtllm_num_requests_running") == 0 and sample(after, "trtllm_num_requests_waiting") == 0
    assert not any(k.split("{")[0].endswith("_created") for k in after)


def test_error_responses_are_counted_by_http_code(server):
    """trtllm_request_error_total{http_code}: each request answered with an error status, by its code (a malformed
    body 400, an unknown model 404, an unknown path 404); successful ones are not counted."""
    base, _ = server
    before = prometheus(base)
    assert httpx.post(base + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
                      ).status_code == 400
    assert httpx.post(base + "/v1/completions", json={"model": "no-such-model", "prompt": "Hi", "max_tokens": 1}
                      ).status_code == 404
    assert httpx.get(base + "/v1/no-such-endpoint").status_code == 404
    assert httpx.get(base + "/health").status_code == 200
    after = prometheus(base)

    def delta(code):
        return (sample(after, "trtllm_request_error_total", http_code=code, model_name=MODEL)
                - sample(before, "trtllm_request_error_total", http_code=code, model_name=MODEL))

    assert (delta("400"), delta("404"), delta("200")) == (1, 2, 0)


def test_health_version_models(server, client):
    import openai

    import dflash_trt

    base = server[0]
    assert httpx.get(base + "/health").status_code == 200
    head = httpx.head(base + "/health")  # load balancers' probe
    assert head.status_code == 200 and head.content == b""
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)  # the counters exist, run alone too
    before = prometheus(base)
    probe = httpx.get(base + "/health_generate", timeout=60)
    assert (probe.status_code, probe.text) == (200, "Generation health check OK")  # trtllm-serve's answer
    assert "content-type" not in probe.headers  # as trtllm-serve sends it (a Response without a media type)
    after = prometheus(base)  # counted as a one-token request, as trtllm-serve counts its probe (a chat request)
    assert sample(after, "trtllm_request_success_total", finished_reason="length") == \
        sample(before, "trtllm_request_success_total", finished_reason="length") + 1
    assert sample(after, "trtllm_generation_tokens_total") == sample(before, "trtllm_generation_tokens_total") + 1
    assert httpx.get(base + "/version").json() == {"version": dflash_trt.__version__}
    [model] = httpx.get(base + "/v1/models").json()["data"]
    assert model["id"] == MODEL and model["object"] == "model" and model["max_model_len"] == 8192
    got = client.models.retrieve(MODEL).model_dump()  # the openai client's "retrieve model"
    assert {k: got[k] for k in model} == model
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-4")
    assert exc.value.code == "model_not_found" and "'gpt-4' does not exist" in exc.value.message


def test_a_client_that_leaves_mid_stream_is_aborted(server, client):
    base = server[0]
    before = sample(prometheus(base), "trtllm_request_success_total", finished_reason="cancelled")
    body = {"prompt": "Write a long story about a dragon.", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    aborted_then_serving(base, before, client)


def test_stop_token_ids_add_to_eos_and_usage_ends_at_the_stop_string(client, smollm2_pipeline):
    pipe = smollm2_pipeline
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0)
    extra = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                                           extra_body={"stop_token_ids": []})
    assert extra.choices[0].message.content == plain.choices[0].message.content
    assert extra.choices[0].finish_reason == plain.choices[0].finish_reason == "stop"  # EOS still stops it
    assert plain.choices[0].stop_reason is None  # the EOS, as vLLM reports it
    eos = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                                         extra_body={"stop_token_ids": list(pipe.engine.eos_token_ids),
                                                     "include_stop_str_in_output": False, "skip_special_tokens": True})
    assert eos.choices[0].finish_reason == "stop" and eos.choices[0].stop_reason is None  # listed, still an EOS
    ref, _ = ar_tokens(pipe, chat_ids(pipe, QUESTION), 40)
    own = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                                         extra_body={"stop_token_ids": [ref[3]]})
    assert own.choices[0].finish_reason == "stop" and own.choices[0].stop_reason == ref[3]
    assert own.usage.completion_tokens == ref.index(ref[3]) + 1
    stop = "of Fr"
    used = next(k for k in range(1, len(ref) + 1) if stop in pipe.decode(ref[:k]))
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, stop=stop)
    assert r.usage.completion_tokens == used  # not the drafts accepted past it
    one = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=1, temperature=0, stop=" ")
    assert one.choices[0].text == "" and one.choices[0].finish_reason == "stop" and one.choices[0].stop_reason == " "
    streamed = list(client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=1, temperature=0, stop=" ",
                                              stream=True))
    assert streamed[-1].choices[0].stop_reason == " "


def test_a_stop_string_ends_usage_metrics_and_the_token_counter_at_the_same_token(server, client, smollm2_pipeline):
    """usage.completion_tokens, the choice's `metrics.completion_tokens` and trtllm_generation_tokens_total all
    count the tokens up to the one that completed the stop string (not the drafts accepted past it), streamed
    or not."""
    pipe, base = smollm2_pipeline, server[0]
    prompt, stop = "def fib(n):", "return"
    ref, _ = ar_tokens(pipe, pipe.encode(prompt), 48)
    used = next(k for k in range(1, len(ref) + 1) if stop in pipe.decode(ref[:k]))
    assert used < len(ref)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stop=[stop])
    before = prometheus(base)
    r = client.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == used
    assert r.choices[0].model_extra["metrics"]["completion_tokens"] == used
    middle = prometheus(base)
    assert sample(middle, "trtllm_generation_tokens_total") - sample(before, "trtllm_generation_tokens_total") == used
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    [last] = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert last.choices[0].model_extra["metrics"]["completion_tokens"] == used == chunks[-1].usage.completion_tokens
    after = prometheus(base)
    assert sample(after, "trtllm_generation_tokens_total") - sample(middle, "trtllm_generation_tokens_total") == used


def test_a_stop_string_never_matches_half_a_character(client, smollm2_pipeline):
    """U+FFFD as a stop string: the half-decoded emoji (U+FFFD until its last byte comes) does not match it; the
    answer is the target's own, streamed or not."""
    pipe = smollm2_pipeline
    prompt = "Emojis: \U0001f642\U0001f643\U0001f600\U0001f601\U0001f602\U0001f923"
    ref, reason = ar_tokens(pipe, pipe.encode(prompt), 24)
    full = pipe.decode(ref)
    assert "\ufffd" not in full
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=["\ufffd"])
    r = client.completions.create(**kwargs)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (full, reason, len(ref))
    streamed = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full and streamed[-1].choices[0].finish_reason == reason


def test_the_prompt_token_counter_counts_each_prompt_once_per_choice(server, client):
    """trtllm_prompt_tokens_total adds each prompt once per choice (each choice reads its prompt: vLLM's
    vllm:prompt_tokens counts the same way); usage.prompt_tokens counts each prompt once (OpenAI)."""
    base = server[0]
    before = sample(prometheus(base), "trtllm_prompt_tokens_total")
    r = client.completions.create(model=MODEL, prompt=["Hi", "Bye"], max_tokens=1, temperature=0, n=3)
    after = sample(prometheus(base), "trtllm_prompt_tokens_total")
    assert len(r.choices) == 6 and after - before == 3 * r.usage.prompt_tokens


class Records(logging.Handler):
    """The records a logger emits while installed (`with Records("uvicorn.error") as r: ...; r.records`)."""

    def __init__(self, name: str):
        super().__init__(logging.DEBUG)
        self.logger, self.records = logging.getLogger(name), []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


def test_a_non_streaming_client_that_leaves_is_aborted(server, client):
    base = server[0]
    before = sample(prometheus(base), "trtllm_request_success_total", finished_reason="cancelled")
    with Records("uvicorn.error") as log:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", timeout=3,
                       json={"prompt": "Write a long story.", "max_tokens": 4000, "temperature": 0, "ignore_eos": True})
        aborted_then_serving(base, before, client)
    assert [r.getMessage() for r in log.records if r.levelno >= logging.WARNING] == []  # a normal abort: no traceback


def test_a_client_that_leaves_while_queued_is_counted_as_aborted(server, client):
    """B is queued behind A (a full batch: max_batch_size 1 here) and its client leaves: B never runs and
    counts once as an abort; A's answer is whole."""
    base, app = server
    before = sample(prometheus(base), "trtllm_request_success_total", finished_reason="cancelled")
    app.state.scheduler.max_batch_size = 1  # else B joins A's batch at once (in-flight batching)
    answers = {}

    def long_request():
        answers["a"] = client.completions.create(model=MODEL, prompt="Write a long story.", max_tokens=400,
                                                 temperature=0, extra_body={"ignore_eos": True})

    wait_idle(app)
    httpx.get(base + "/metrics")  # the iterations so far
    completed = sample(prometheus(base), "trtllm_num_requests_completed_total")
    a = threading.Thread(target=long_request)
    a.start()
    try:
        deadline = time.time() + 60
        while sample(prometheus(base), "trtllm_num_requests_running") < 1:
            assert time.time() < deadline, "A did not start"
            time.sleep(0.05)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", timeout=1, json={"prompt": "Hi", "max_tokens": 5, "temperature": 0})
        a.join(120)
    finally:
        app.state.scheduler.max_batch_size = 4
    assert answers["a"].usage.completion_tokens == 400
    aborted_then_serving(base, before, client)
    wait_idle(app)
    after = prometheus(base)
    assert sample(after, "trtllm_request_success_total", finished_reason="cancelled") == before + 1
    assert not any('finished_reason="abort"' in key for key in after)  # TensorRT-LLM's label value only
    # B never joined a batch: no iteration counts it, as TensorRT-LLM's PyExecutor (A and the request after it do)
    assert sum(i["numCompletedRequests"] for i in httpx.get(base + "/metrics").json()) == 2
    assert sample(after, "trtllm_num_requests_completed_total") - completed == 2


def test_health_generate_answers_500_with_the_failure_as_trtllm_serve(server, smollm2_pipeline, monkeypatch):
    """A probe whose one-token generation fails answers 500 and trtllm-serve's text with the error; the next
    probe, the model working again, answers 200."""
    target = smollm2_pipeline.engine.target
    forward = target.forward

    def failing(*args, **kwargs):
        raise RuntimeError("the target's forward failed (injected)")

    monkeypatch.setattr(target, "forward", failing)
    with Records("dflash_trt.serve") as log:
        probe = httpx.get(server[0] + "/health_generate", timeout=60)
    monkeypatch.setattr(target, "forward", forward)
    assert (probe.status_code, probe.text) == (
        500, "Generation health check failed: the target's forward failed (injected)")
    assert "content-type" not in probe.headers  # (trtllm-serve's)
    assert [r.getMessage() for r in log.records if r.levelno >= logging.ERROR] == [
        "dflash-trt: GET /health_generate: the one-token generation failed"]
    assert httpx.get(server[0] + "/health_generate", timeout=60).text == "Generation health check OK"


def test_a_failed_generation_is_a_500_and_the_connection_stays_open(server, client, smollm2_pipeline, monkeypatch):
    """A RuntimeError inside the target's forward (not a DFlash error: a bug, an out-of-memory) answers the
    request with a 500 and OpenAI's error body, logs its traceback once under `dflash_trt.serve`, and the
    client's keep-alive connection serves its next request (uvicorn closed it before `ServerErrors`); a
    stream that fails carries the same error in-band, its traceback logged too."""
    import http.client

    target = smollm2_pipeline.engine.target
    forward, failing = target.forward, {"on": False}

    def forward_or_fail(*args, **kwargs):
        if failing["on"]:
            raise RuntimeError("the target's forward failed (injected)")
        return forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", forward_or_fail)
    body = json.dumps({"prompt": "Hi", "max_tokens": 3, "temperature": 0})
    conn = http.client.HTTPConnection(server[0].removeprefix("http://"), timeout=60)
    with Records("dflash_trt.serve") as log, Records("uvicorn.error") as uvicorn_log:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        ok = conn.getresponse()
        assert ok.status == 200 and len(json.loads(ok.read())["choices"]) == 1
        sock = conn.sock
        failing["on"] = True
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            failed = conn.getresponse()
            assert failed.status == 500 and failed.getheader("connection") != "close"
            assert json.loads(failed.read()) == {"error": {
                "message": "generation failed: the target's forward failed (injected)", "type": "server_error",
                "param": None, "code": None}}
            events = [line for line in httpx.post(server[0] + "/v1/completions", timeout=60, json={
                "prompt": "Hi", "max_tokens": 3, "stream": True}).text.splitlines() if line]
        finally:
            failing["on"] = False
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        again = conn.getresponse()
        assert again.status == 200 and conn.sock is sock  # the same connection
        assert json.loads(again.read())["usage"]["completion_tokens"] == 3
    conn.close()
    error = ('data: {"error": {"message": "generation failed: the target\'s forward failed (injected)", '
             '"type": "server_error", "param": null, "code": null}}')
    assert events == [error, "data: [DONE]"]
    failures = [r for r in log.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in failures] == ["dflash-trt: POST /v1/completions failed"] * 2
    assert all(r.exc_info and "injected" in str(r.exc_info[1]) for r in failures)
    assert [r.getMessage() for r in uvicorn_log.records if r.levelno >= logging.WARNING] == []


def test_completions_return_context_logits_as_trtllm_serve(client, server, smollm2_pipeline):
    """trtllm-serve's CompletionRequest.return_context_logits: each choice of a whole answer has `context_logits`, the
    target's raw logits at every prompt position ([prompt tokens][V], the runtime's own), a stream none (its chunks
    have no such field); its chat completions have no such field, so chat refuses true saying why and where to go."""
    import openai
    import torch

    pipe = smollm2_pipeline
    prompt = "The three primary colors are"
    [ref] = pipe.generate([pipe.encode(prompt)], SamplingParams(max_tokens=3, return_context_logits=True), mode="ar")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  extra_body={"return_context_logits": True})
    got = torch.tensor(r.choices[0].model_extra["context_logits"])
    assert got.shape == ref.context_logits.shape == (len(pipe.encode(prompt)), pipe.engine.target.config.vocab_size)
    torch.testing.assert_close(got, ref.context_logits, atol=2e-3, rtol=0)
    assert r.choices[0].text == ref.text
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert "context_logits" not in (plain.choices[0].model_extra or {})
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, stream=True,
                                            extra_body={"return_context_logits": True}))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert all("context_logits" not in (c.choices[0].model_extra or {}) for c in chunks)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"return_context_logits": True})
    assert info.value.body["param"] == "return_context_logits"
    assert ("return_context_logits=True is not supported by this server (DFlash runtime); leave it out (chat "
            "completions return no logits, as trtllm-serve's; /v1/completions with return_context_logits: true gives "
            "each choice the prompt's context_logits)") in info.value.body["message"]
    r = httpx.post(server[0] + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1,
                                                        "return_context_logits": "yes"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_context_logits", r.text
