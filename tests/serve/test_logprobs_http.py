"""`logprobs` over real HTTP with the real `openai` client: Chat Completions (`logprobs`, `top_logprobs`)
and Completions (`logprobs: N`), streamed and not, checked against a Hugging Face forward of the target
over the answer (teacher forcing) and against each other."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from dflash_trt.runtime.sampling import SamplingParams
from tests.runtime.test_logprobs import reference
from tests.serve.test_openai_server import MODEL, QUESTION, ar_tokens, chat_ids, prometheus, sample

TOL = 1e-3  # float32 logits of a 16-token verify vs one HF forward over the whole sequence


@pytest.fixture(scope="module")
def hf_target(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def test_chat_logprobs_are_the_targets(client, smollm2_pipeline, hf_target):
    pipe = smollm2_pipeline
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, logprobs=True,
                                       top_logprobs=3)
    choice = r.choices[0]
    content = choice.logprobs.content
    prompt = chat_ids(pipe, QUESTION)
    out, _ = ar_tokens(pipe, prompt, 24)
    assert len(content) == r.usage.completion_tokens == len(out)
    assert [e.token for e in content] == [pipe.tokenizer.decode([t]) for t in out]
    assert b"".join(bytes(e.bytes) for e in content).decode() == pipe.tokenizer.decode(out)
    ref = reference(hf_target, prompt, out)
    for e, t, row in zip(content, out, ref):
        assert e.logprob <= 0 and abs(e.logprob - float(row[t])) < TOL
        assert abs(e.logprob - float(row.max())) < TOL  # greedy: the argmax, the largest logprob
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert [x.logprob for x in e.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=TOL)


def test_streamed_logprobs_add_up_to_the_whole_answer(client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-6)
    assert chunks[0].choices[0].logprobs is None  # the opening chunk (role only) carries no tokens


def test_completions_logprobs_shape_and_sampled_tokens(client, smollm2_pipeline, hf_target):
    pipe = smollm2_pipeline
    prompt = "def fibonacci(n):"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=5, logprobs=2,
                                  n=2)
    prompt_ids = pipe.encode(prompt)
    for j, choice in enumerate(r.choices):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 16
        assert "".join(lp.tokens) == choice.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(16)]
        for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert tok in top and top[tok] == value and 2 <= len(top) <= 3  # the 2 best and the sampled one
        # sampled at temperature 1 (choice j with seed 5 + j, as the runtime samples it), the logprobs are
        # still the raw distribution's: an HF forward over those tokens
        [run] = pipe.generate([prompt_ids], SamplingParams(temperature=1.0, max_tokens=16, seed=5 + j))
        assert run.text == choice.text
        ref = reference(hf_target, prompt_ids, run.token_ids)
        assert lp.token_logprobs == pytest.approx([float(ref[i, t]) for i, t in enumerate(run.token_ids)], abs=TOL)
        assert any(v < float(ref[i].max()) - 0.1 for i, v in enumerate(lp.token_logprobs))  # not all argmax


def test_completions_logprobs_zero_lists_the_sampled_token_only_and_streams(client):
    kwargs = dict(model=MODEL, prompt="The three primary colors are", max_tokens=12, temperature=0, logprobs=0)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    assert all(list(top) == [tok] for tok, top in zip(whole.tokens, whole.top_logprobs))
    chunks = list(client.completions.create(**kwargs, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == whole.tokens
    assert [o for p in parts for o in p.text_offset] == whole.text_offset  # offsets carry on across chunks
    assert all(math.isfinite(v) and v <= 0 for v in whole.token_logprobs)


def test_a_stop_string_ends_the_logprobs_with_the_text(client):
    kwargs = dict(model=MODEL, prompt="def add(a, b):", max_tokens=40, temperature=0, logprobs=1)
    full = client.completions.create(**kwargs).choices[0]
    stop = full.text[6:9]
    assert stop.strip()
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(**kwargs, stop=stop, stream=True))
            tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
            text = "".join(c.choices[0].text for c in chunks)
        else:
            r = client.completions.create(**kwargs, stop=stop).choices[0]
            tokens, text = r.logprobs.tokens, r.text
            assert len(tokens) == client.completions.create(**kwargs, stop=stop).usage.completion_tokens
        assert text == full.text[: full.text.index(stop)]
        assert tokens == full.logprobs.tokens[: len(tokens)] and stop in "".join(tokens)
        assert stop not in "".join(tokens[:-1])  # the token that completed the stop string is the last one


def test_echo_gives_the_prompts_logprobs_as_lm_eval_asks_for_them(server, smollm2_pipeline, hf_target):
    """lm-evaluation-harness's loglikelihood request (token ids of context + continuation, max_tokens 1, echo,
    logprobs 1, temperature 0): the prompt's tokens come first, the first with null logprob and
    top_logprobs, the others with the target's log-probabilities (a Hugging Face forward over the prompt)."""
    from tests.runtime.test_logprobs import prompt_reference

    pipe = smollm2_pipeline
    context, continuation = pipe.encode("The capital of France is"), pipe.encode(" Paris")
    prompt = context + continuation
    r = httpx.post(server[0] + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1 == r.json()["usage"]["prompt_tokens"] + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert choice["text"] == pipe.tokenizer.decode(prompt) + lp["tokens"][-1]
    ref = prompt_reference(hf_target, prompt)
    assert lp["token_logprobs"][1 : len(prompt)] == pytest.approx(
        [float(ref[i, t]) for i, t in enumerate(prompt[1:])], abs=TOL)
    # what lm-eval reads: the continuation's summed logprob and whether it is the greedy continuation
    cont = lp["token_logprobs"][len(context) : -1]
    assert sum(cont) == pytest.approx(sum(float(ref[len(context) - 1 + i, t]) for i, t in enumerate(continuation)),
                                      abs=TOL)
    greedy = all(max(top, key=top.get) == tok for tok, top in zip(lp["tokens"][len(context) : -1],
                                                                  lp["top_logprobs"][len(context) : -1]))
    assert greedy == all(int(ref[len(context) - 1 + i].argmax()) == t for i, t in enumerate(continuation))
    assert lp["text_offset"][len(prompt)] == sum(len(t) for t in lp["tokens"][:-1])


def test_echo_without_logprobs_prepends_the_prompt_text(client):
    plain = client.completions.create(model=MODEL, prompt=["def add(a, b):", "Once"], max_tokens=6, temperature=0)
    echo = client.completions.create(model=MODEL, prompt=["def add(a, b):", "Once"], max_tokens=6, temperature=0,
                                     echo=True)
    assert [c.text for c in echo.choices] == ["def add(a, b):" + plain.choices[0].text, "Once" + plain.choices[1].text]
    assert echo.choices[0].logprobs is None and echo.usage == plain.usage


def test_max_tokens_zero_with_echo_scores_the_prompt(server, client):
    """OpenAI's legacy scoring request: max_tokens 0 and echo return the prompt and its logprobs, nothing
    generated: the same prompt logprobs as with max_tokens 1, and usage counts no completion token."""
    prompt = ["The capital of France is Paris.", "def add(a, b):"]
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2)
    zero = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, echo=True, logprobs=2)
    assert [c.text for c in zero.choices] == prompt
    assert zero.usage.completion_tokens == 0 and zero.usage.prompt_tokens == one.usage.prompt_tokens
    for z, o in zip(zero.choices, one.choices):
        assert z.finish_reason == "length"
        assert z.logprobs.tokens == o.logprobs.tokens[:-1]
        assert z.logprobs.token_logprobs == o.logprobs.token_logprobs[:-1]
        assert z.logprobs.top_logprobs == o.logprobs.top_logprobs[:-1]
        assert z.logprobs.text_offset == o.logprobs.text_offset[:-1]
    assert all(c.model_extra["metrics"]["completion_tokens"] == 0 for c in zero.choices)
    before = prometheus(server[0])
    bare = client.completions.create(model=MODEL, prompt=prompt[0], max_tokens=0, echo=True)
    assert bare.choices[0].text == prompt[0] and bare.choices[0].logprobs is None
    after = prometheus(server[0])  # the token generated to read the prompt is not counted either
    assert sample(after, "trtllm_generation_tokens_total") == sample(before, "trtllm_generation_tokens_total")
    assert sample(after, "trtllm_prompt_tokens_total") > sample(before, "trtllm_prompt_tokens_total")
    # a request like any other for the latency metrics (the e2e histogram counts it), without a first token
    for name, added, labels in (("trtllm_request_success_total", 1, {"finished_reason": "length"}),
                                ("trtllm_e2e_request_latency_seconds_count", 1, {}),
                                ("trtllm_request_inference_time_seconds_count", 1, {}),
                                ("trtllm_time_to_first_token_seconds_count", 0, {}),
                                ("trtllm_request_prefill_time_seconds_count", 0, {})):
        assert sample(after, name, **labels) - sample(before, name, **labels) == added, name
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 0})
    assert r.status_code == 400 and "0 is allowed with echo" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": -1, "echo": True})
    assert r.status_code == 400 and "got -1 (0 is allowed with echo" in r.json()["error"]["message"]


@pytest.mark.parametrize("max_tokens, logprobs", [(6, 2), (6, None), (0, 1)])
@pytest.mark.parametrize("as_ids", [False, True])
def test_streamed_echo_equals_the_echo_without_streaming(client, smollm2_pipeline, max_tokens, logprobs, as_ids):
    """echo with stream (vLLM's form): each choice's first chunk is its prompt (and, with logprobs, the
    prompt's tokens and logprobs), then its completion's chunks; joined, a choice's text and logprobs are the
    non-streamed echo's, text_offset included (counted from the prompt's start). Two prompts (strings, or
    token ids), n 2; max_tokens 0 scores the prompts, streamed too (no completion text)."""
    given = ["def add(a, b):", "Once upon a time"]
    prompt = [smollm2_pipeline.encode(g) for g in given] if as_ids else given
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, echo=True, logprobs=logprobs, n=2)
    whole = client.completions.create(**kwargs)
    text, lps, first = ["", "", "", ""], [[] for _ in range(4)], [None] * 4
    for c in client.completions.create(**kwargs, stream=True):
        ch = c.choices[0]
        if first[ch.index] is None:
            first[ch.index] = ch.text
        text[ch.index] += ch.text
        if ch.logprobs is not None:
            lps[ch.index].append(ch.logprobs)
    assert first == [given[i // 2] for i in range(4)]  # the prompt comes first, whole
    assert text == [c.text for c in whole.choices] and all(t.startswith(given[i // 2]) for i, t in enumerate(text))
    if max_tokens == 0:
        assert text == first
    else:
        assert all(len(t) > len(given[i // 2]) for i, t in enumerate(text))
    for got, c in zip(lps, whole.choices):
        if logprobs is None:
            assert got == [] and c.logprobs is None
            continue
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for part in got for x in getattr(part, field)] == getattr(c.logprobs, field)
        assert len(got[0].tokens) == len(smollm2_pipeline.encode(c.text[: len(given[c.index // 2])]))
        assert got[0].token_logprobs[0] is None  # the prompt's first token: nothing predicts it


def completion_token_bytes(token: str) -> bytes:
    """The bytes a Completions token string stands for: its UTF-8, or the escapes of "bytes:\\xNN..."."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
    return token.encode()


def test_partial_character_tokens_keep_their_bytes_names_and_offsets(server, smollm2_pipeline):
    """Emoji are several byte-level tokens each: in Completions such a token is named by its bytes
    ("bytes:\\xf0\\x9f", so the 5 alternatives stay 5 distinct keys) and `text_offset` counts characters of
    the text, not of U+FFFD placeholders; streamed, the tokens and offsets are the same."""
    from dflash_trt.text import token_bytes

    tok = smollm2_pipeline.tokenizer
    body = {"model": MODEL, "prompt": "Emoji: \U0001F431\U0001F436", "max_tokens": 6, "temperature": 0, "logprobs": 5,
            "echo": True}
    r = httpx.post(server[0] + "/v1/completions", timeout=120, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    ids = smollm2_pipeline.encode(body["prompt"])
    assert any(t.startswith("bytes:") for t in lp["tokens"][: len(ids)])  # the prompt's emoji are split
    assert [completion_token_bytes(t) for t in lp["tokens"][: len(ids)]] == [token_bytes(tok, i) for i in ids]
    joined = b"".join(completion_token_bytes(t) for t in lp["tokens"])
    assert joined.startswith(text.encode()) and len(joined) - len(text.encode()) < 4  # at most a cut character
    for top in lp["top_logprobs"][1:]:
        assert len(top) in (5, 6)  # the 5 best and the chosen one: no two alternatives collapse into one key
    before = b""
    for t, off in zip(lp["tokens"], lp["text_offset"]):
        # the characters before the token's own: what its predecessors' bytes complete
        assert off == len(before.decode("utf-8", "ignore")) and text[:off].encode() == before[: len(text[:off].encode())]
        before += completion_token_bytes(t)
    plain = {**body, "echo": False}
    whole = httpx.post(server[0] + "/v1/completions", timeout=120, json=plain).json()["choices"][0]["logprobs"]
    with httpx.stream("POST", server[0] + "/v1/completions", timeout=120, json={**plain, "stream": True}) as s:
        parts = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [c["choices"][0]["logprobs"] for c in parts if c["choices"][0]["logprobs"]]
    assert [t for p in streamed for t in p["tokens"]] == whole["tokens"] == lp["tokens"][len(ids):]
    assert [o for p in streamed for o in p["text_offset"]] == whole["text_offset"]


def test_the_token_after_a_broken_character_starts_after_its_replacement(server, smollm2_pipeline):
    """A prompt of token 10813 (bytes f0 9f: half of an emoji) and then tokens that do not complete it: the text
    is U+FFFD and theirs, each token's text_offset is where its own text starts (the U+FFFD is the broken
    token's), and text[offset:] starts with the token's text."""
    pipe = smollm2_pipeline
    rest = pipe.encode("-12")
    body = {"model": MODEL, "prompt": [10813, *rest], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    choice = httpx.post(server[0] + "/v1/completions", timeout=120, json=body).json()["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    assert lp["tokens"][0] == "bytes:\\xf0\\x9f" and text.startswith("\ufffd-12")
    offsets = lp["text_offset"]
    assert offsets[: len(rest) + 1] == [0] + [1 + len(pipe.decode(rest[:k])) for k in range(len(rest))]
    for tok, off in zip(lp["tokens"][1:], offsets[1:]):
        assert text[off:].startswith(tok)


@pytest.mark.parametrize("question", ["Emoji for cat?", "Say 'h\u00e9llo \U0001F30D \u4e16\u754c' three times."])
def test_each_streamed_chunk_carries_the_logprobs_of_its_own_text(client, question):
    """A character split over several tokens is held back until whole, and with logprobs the text is sent
    at token boundaries (a token holding " " and half of an emoji waits with its space), so every chunk's
    tokens spell exactly that chunk's text (the last chunk: plus the tokens not shown, <|im_end|>)."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=12,
                  temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert any(not _decodes(bytes(e.bytes)) for e in whole)  # the answer holds characters split over tokens
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    for c in chunks[1:-1]:
        carried = b"".join(bytes(e.bytes) for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else []))
        assert carried == (c.choices[0].delta.content or "").encode()
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes, e.logprob) for e in streamed] == [(e.token, e.bytes, e.logprob) for e in whole]


def test_streamed_completion_chunks_spell_their_tokens_and_stops_never_leak(server):
    """Completions, streamed: " \U0001F30D" is the tokens b" \\xf0\\x9f", b"\\x8c", b"\\x8d" here; the space
    goes out with them, so each chunk's tokens spell its text. And a stop string made of emoji is held back
    while its characters are still being decoded: the stream's text equals the non-streamed text."""
    body = {"model": MODEL, "prompt": "hello \U0001F30D hello \U0001F30D hello \U0001F30D hello", "max_tokens": 10,
            "temperature": 0}

    def streamed(extra):
        with httpx.stream("POST", server[0] + "/v1/completions", timeout=120, json={**body, **extra, "stream": True}) as s:
            return [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line.startswith("data: {")]

    chunks = streamed({"logprobs": 1})
    split = [c for c in chunks if c["logprobs"] and any(t.startswith("bytes:") for t in c["logprobs"]["tokens"])]
    assert split  # the answer repeats the emoji, split over tokens
    for c in chunks[:-1]:
        tokens = c["logprobs"]["tokens"] if c["logprobs"] else []
        assert b"".join(completion_token_bytes(t) for t in tokens) == c["text"].encode()
    whole = httpx.post(server[0] + "/v1/completions", timeout=120, json={**body, "logprobs": 1}).json()["choices"][0]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for n, stop in ((1, "\U0001F30D\U0001F30D"), (2, "\U0001F30D\U0001F30D\U0001F30D")):
        plain = httpx.post(server[0] + "/v1/completions", timeout=120, json={**body, "stop": [stop], "n": n}).json()
        texts = [c["text"] for c in plain["choices"]]
        got = [""] * n
        for c in streamed({"stop": [stop], "n": n}):
            got[c["index"]] += c["text"]
        assert got == texts and all(stop[0] not in t for t in texts)


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("path, body, message", [
    ("/v1/chat/completions", {"messages": QUESTION, "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, "top_logprobs must be"),
    ("/v1/chat/completions", {"messages": QUESTION, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, "logprobs must be an integer in [0, 20]"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": QUESTION, "echo": True}, "echo=True is not supported"),
])
def test_bad_logprobs_requests_are_refused_and_the_server_keeps_serving(server, client, path, body, message):
    r = httpx.post(server[0] + path, json={"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"]
    assert err["param"] in ("logprobs", "top_logprobs", "echo")
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0, logprobs=1)
    assert len(ok.choices[0].logprobs.tokens) == 2
