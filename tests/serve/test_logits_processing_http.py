"""Logits processing over the OpenAI server (real HTTP on 127.0.0.1, the real `openai` client): presence,
frequency and repetition penalties, `logit_bias`, `min_tokens`, `min_p` and `bad_words` give exactly the runtime's greedy
tokens for the same SamplingParams (autoregressive, so DFlash's output is checked too); `min_tokens` holds
back stop strings as well as stop tokens, streamed or not; bad values are a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from dflash_trt.runtime.sampling import SamplingParams
from tests.serve.test_openai_server import MODEL, QUESTION, chat_ids

#: a prompt the target continues by repeating itself (", 6, 7, ..."): what the penalties change
COUNTING = "1, 2, 3, 4, 5,"
#: a chat question the target answers in three tokens: "No." and <|im_end|>
YES_NO = [{"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}]


def runtime(pipe, ids: list[int], **params):
    """The runtime's own greedy result for `ids` with SamplingParams(**params) (autoregressive)."""
    [res] = pipe.generate([ids], SamplingParams(**params), mode="ar")
    return res


@pytest.mark.parametrize("extra, params", [
    ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
    ({"presence_penalty": 1.5, "frequency_penalty": 1.0}, {"presence_penalty": 1.5, "frequency_penalty": 1.0}),
    ({"logit_bias": {"28": 100}}, {"logit_bias": {28: 100.0}}),
    ({"frequency_penalty": 1.0, "prompt_ignore_length": 0}, {"frequency_penalty": 1.0, "prompt_ignore_length": 0}),
])
def test_penalties_and_logit_bias_give_the_runtimes_tokens(client, smollm2_pipeline, extra, params):
    body = dict(model=MODEL, prompt=COUNTING, max_tokens=12, temperature=0)  # plain: " 6, 7, 8, 9,"
    plain = client.completions.create(**body)
    r = client.completions.create(**body, extra_body=extra)
    ref = runtime(smollm2_pipeline, smollm2_pipeline.encode(COUNTING), max_tokens=12, **params)
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.choices[0].text != plain.choices[0].text


def test_bad_words_are_kept_out_of_the_answer_as_the_runtime_keeps_them(client, smollm2_pipeline):
    """vLLM's `bad_words`: each word, as written and after a space, never completes in the answer; the tokens are
    the runtime's own for the same token sequences, streamed or not."""
    from dflash_trt.runtime.penalties import bad_word_ids

    pipe = smollm2_pipeline
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    body = dict(model=MODEL, messages=question, max_tokens=24, temperature=0)
    plain = client.chat.completions.create(**body).choices[0].message.content
    assert "Paris" in plain
    r = client.chat.completions.create(**body, extra_body={"bad_words": ["Paris", "capital of"]})
    bad = bad_word_ids(["Paris", "capital of"], lambda w: pipe.tokenizer.encode(w, add_special_tokens=False))
    ref = runtime(pipe, chat_ids(pipe, question), max_tokens=24, bad_words=bad)
    assert r.choices[0].message.content == ref.text and "Paris" not in ref.text and "capital of" not in ref.text
    chunks = client.chat.completions.create(**body, stream=True, extra_body={"bad_words": ["Paris", "capital of"]})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text


def test_repetition_penalty_in_chat_streamed_or_not(client, smollm2_pipeline):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, extra_body={"repetition_penalty": 1.3})
    whole = client.chat.completions.create(**kwargs)
    ref = runtime(smollm2_pipeline, chat_ids(smollm2_pipeline, QUESTION), max_tokens=12, repetition_penalty=1.3)
    assert whole.choices[0].message.content == ref.text
    plain = runtime(smollm2_pipeline, chat_ids(smollm2_pipeline, QUESTION), max_tokens=12)
    assert ref.token_ids != plain.token_ids
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text


def test_logit_bias_minus_100_bans_the_first_token(client, smollm2_pipeline):
    ids = chat_ids(smollm2_pipeline, QUESTION)
    first = runtime(smollm2_pipeline, ids, max_tokens=1).token_ids[0]  # "The"
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                       logit_bias={str(first): -100})
    ref = runtime(smollm2_pipeline, ids, max_tokens=6, logit_bias={first: -100})
    assert ref.token_ids[0] != first and r.choices[0].message.content == ref.text
    assert not r.choices[0].message.content.startswith(smollm2_pipeline.decode([first]))


def test_min_tokens_outlasts_the_eos_and_stop_strings(client, smollm2_pipeline):
    """min_tokens 6 on a three-token answer ("No." and EOS): at least 6 tokens, the runtime's; the stop string
    "." that ends token 2 is text then (vLLM's rule: every stop check waits for min_tokens), streamed or not."""
    kwargs = dict(model=MODEL, messages=YES_NO, max_tokens=10, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    assert plain.choices[0].message.content == "No." and plain.usage.completion_tokens == 3
    assert client.chat.completions.create(**kwargs, stop=["."]).choices[0].message.content == "No"
    r = client.chat.completions.create(**kwargs, extra_body={"min_tokens": 6})
    ref = runtime(smollm2_pipeline, chat_ids(smollm2_pipeline, YES_NO), max_tokens=10, min_tokens=6)
    assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == len(ref.token_ids) >= 6
    assert r.choices[0].finish_reason == ref.finish_reason
    cut = client.chat.completions.create(**kwargs, stop=["."], extra_body={"min_tokens": 6})
    text = cut.choices[0].message.content
    assert text.startswith("No.") and ref.text.startswith(text)  # the first "." is text, not a stop
    assert (cut.choices[0].finish_reason == "stop") == (len(text) < len(ref.text))
    assert cut.usage.completion_tokens >= 6
    chunks = list(client.chat.completions.create(**kwargs, stop=["."], extra_body={"min_tokens": 6}, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [cut.choices[0].finish_reason]


def test_min_p_1_keeps_only_the_top_token(client, smollm2_pipeline):
    """min_p 1 drops every token less likely than the top one: sampling at temperature 1 is greedy then."""
    r = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=8, temperature=1.0, seed=3,
                                  extra_body={"min_p": 1.0})
    assert r.choices[0].text == runtime(smollm2_pipeline, smollm2_pipeline.encode(COUNTING), max_tokens=8).text


BAD = [
    ("chat/completions", {"messages": QUESTION, "presence_penalty": 3}, "presence_penalty",
     "presence_penalty must be in [-2, 2] (OpenAI's range), got 3.0"),
    ("chat/completions", {"messages": QUESTION, "frequency_penalty": "1"}, "frequency_penalty",
     "frequency_penalty: Input should be a valid number"),
    ("chat/completions", {"messages": QUESTION, "repetition_penalty": 0}, "repetition_penalty",
     "repetition_penalty must be finite and > 0 (1 = off), got 0.0"),
    ("chat/completions", {"messages": QUESTION, "logit_bias": {"abc": 1}}, "logit_bias",
     "logit_bias key 'abc' is not a token id"),
    ("completions", {"prompt": "hi", "logit_bias": {"-5": 1}}, "logit_bias", "logit_bias key '-5' is not a token id"),
    ("completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias",
     "logit_bias key '99999999' is outside the vocabulary [0, 49152)"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "logit_bias[5] must be in [-100, 100]"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": True}}, "logit_bias", "logit_bias.5: Input should be"),
    ("chat/completions", {"messages": QUESTION, "max_tokens": 4, "min_tokens": 5}, "min_tokens",
     "min_tokens must be in [0, max_tokens = 4], got 5"),
    ("completions", {"prompt": "hi", "min_tokens": 17}, "min_tokens",
     "min_tokens must be in [0, max_tokens = 16], got 17"),  # the server's default max_tokens
    ("completions", {"prompt": "hi", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens",
     "min_tokens must be 0 with max_tokens 0"),
    ("completions", {"prompt": "hi", "min_tokens": -1}, "min_tokens", "min_tokens must be in [0, max_tokens"),
    ("completions", {"prompt": "hi", "min_p": 1.5, "stream": True}, "min_p", "min_p must be in [0, 1]"),
    ("completions", {"prompt": "hi", "prompt_ignore_length": -2}, "prompt_ignore_length",
     "prompt_ignore_length must be >= 0"),
    ("chat/completions", {"messages": QUESTION, "bad_words": ["ok", ""]}, "bad_words",
     "bad_words[1] must be a non-empty string, got ''"),
    ("completions", {"prompt": "hi", "bad_words": ["a\ud800b"]}, "bad_words",
     "bad_words[0] is not valid Unicode (a lone surrogate)"),
    ("completions", {"prompt": "hi", "bad_words": ["w"] * 1001}, "bad_words", "bad_words holds 1001 words; give at most 1000"),
    ("completions", {"prompt": "hi", "bad_words": ["a", "b"], "temperature": 1.0, "response_format": {
        "type": "regex", "regex": "[ab]"}}, None, "bad_words ban every token this request may choose after 0 output tokens"),
    ("completions", {"prompt": "hi", "bad_words": "Paris"}, "bad_words", "bad_words: Input should be a valid list"),
    ("completions", {"prompt": "hi", "bad_words": [3]}, "bad_words", "bad_words.0: Input should be a valid string"),
]


@pytest.mark.parametrize("endpoint, body, param, words", BAD)
def test_bad_values_are_a_400_naming_the_field_and_the_server_goes_on(server, client, endpoint, body, param, words):
    r = httpx.post(f"{server[0]}/v1/{endpoint}", content=json.dumps(body),  # ASCII JSON: a lone surrogate as \ud800
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param, error
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0,
                                   extra_body={"min_tokens": 2, "repetition_penalty": 1.1})
    assert ok.usage.completion_tokens == 2
