"""Structured output over the OpenAI server (real HTTP on 127.0.0.1, the real `openai` client): `response_format`
json_schema / json_object (OpenAI's) and json / regex / ebnf (trtllm-serve's) give exactly the runtime's greedy
tokens under the same grammar, streamed or not, and the JSON parses; a bad format is a 400 naming
response_format, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from dflash_trt.runtime.guided import GuidedDecoding
from dflash_trt.runtime.sampling import SamplingParams
from tests.serve.test_openai_server import MODEL, chat_ids

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
          "required": ["city", "country"], "additionalProperties": False}
CAPITAL = [{"role": "user", "content": "What is the capital of France? Reply in JSON."}]


def runtime_text(pipe, ids: list[int], spec: GuidedDecoding, max_tokens: int) -> str:
    [res] = pipe.generate([ids], SamplingParams(max_tokens=max_tokens, guided=spec), mode="ar")
    return res.text


def test_json_schema_gives_the_runtimes_tokens_and_parses(client, smollm2_pipeline):
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=40, temperature=0, response_format=fmt)
    text = r.choices[0].message.content
    assert text == runtime_text(smollm2_pipeline, chat_ids(smollm2_pipeline, CAPITAL), GuidedDecoding(json=SCHEMA), 40)
    assert r.choices[0].finish_reason == "stop" and set(json.loads(text)) == {"city", "country"}
    chunks = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=40, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    plain = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=40, temperature=0)
    assert plain.choices[0].message.content != text


@pytest.mark.parametrize("fmt, spec", [
    ({"type": "json_object"}, GuidedDecoding(json_object=True)),
    ({"type": "json", "schema": SCHEMA}, GuidedDecoding(json=SCHEMA)),
    ({"type": "regex", "regex": "(yes|no)"}, GuidedDecoding(regex="(yes|no)")),
    ({"type": "ebnf", "ebnf": 'root ::= "The answer is " ("yes" | "no") "."'},
     GuidedDecoding(grammar='root ::= "The answer is " ("yes" | "no") "."')),
    ({"type": "text"}, None),
])
def test_each_format_gives_the_runtimes_tokens(client, smollm2_pipeline, fmt, spec):
    prompt = "Is the sky blue? Answer:"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"response_format": fmt})
    ids = smollm2_pipeline.encode(prompt)
    [ref] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=24, guided=spec), mode="ar")
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    if fmt["type"] == "regex":
        assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fmt, message", [
    ({"type": "regex"}, "response_format of type 'regex' needs regex (a string)"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs json_schema.schema (an object)"),
    ({"type": "structural_tag"}, "response_format type 'structural_tag' is not supported by this server; use one of "
                                 "text, json_object, json_schema, json, regex, ebnf"),
    ("json", 'response_format must be an object with a "type"'),
    ({"type": "regex", "regex": "(unclosed"}, "guided decoding: the regex does not compile: Regex parsing error"),
    ({"type": "ebnf", "ebnf": "root ::= missing"}, "guided decoding: the grammar does not compile"),
    ({"type": "json", "schema": {"allOf": [{"type": "object"}]}}, "the JSON schema keyword 'allOf' (at #) is not "
                                                                  "supported"),
    ({"type": "regex", "regex": ""}, "guided decoding: regex must be a non-empty string"),
])
def test_a_bad_format_is_a_400_and_the_server_keeps_serving(server, client, fmt, message):
    r = httpx.post(server[0] + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "response_format": fmt})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "response_format"
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("fmt, name", [({"type": "regex", "regex": "a\ud800"}, "regex"),
                                       ({"type": "ebnf", "ebnf": 'root ::= "\ud800"'}, "grammar")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_in_a_regex_or_grammar_is_a_400(server, fmt, name, stream):
    """JSON's "\ud800" escape: text XGrammar cannot encode (once a 500 "generation failed", streamed or not)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "response_format": fmt,
            "stream": stream}
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=60, content=json.dumps(body),  # ASCII: the escape
                   headers={"content-type": "application/json"})
    at = 2 if name == "regex" else 11
    assert r.status_code == 400 and r.json()["error"] == {
        "message": f"guided decoding: the {name} holds an unpaired surrogate (U+D800) at character {at}, which is not a "
                   "character; send valid Unicode text", "type": "invalid_request_error", "param": "response_format",
        "code": None}, r.text


def test_min_tokens_with_a_format_is_refused(server):
    r = httpx.post(server[0] + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 8, "min_tokens": 2, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "min_tokens and guided decoding do not go together" in r.text


def test_ignore_eos_with_a_format_is_refused_naming_it(server):
    r = httpx.post(server[0] + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 8, "ignore_eos": True, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"
    assert "ignore_eos and response_format do not go together" in r.json()["error"]["message"]
