"""Reasoning outputs (`--reasoning-parser`) and `chat_template_kwargs` over the OpenAI server (real HTTP on 127.0.0.1,
the real `openai` client): the answer's `<think>...</think>` goes to reasoning_content and the rest to content, as
the runtime's own answer splits, streamed or not (the deltas of each field join to the message's); tool calls are
read from the content; a template variable reaches the chat template."""

from __future__ import annotations

import copy
import json
import random

import httpx
import pytest

from dflash_trt.runtime.guided import GuidedDecoding
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.serve.chat import ChatAnswers
from dflash_trt.serve.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning
from dflash_trt.serve.tools import ToolCalling
from dflash_trt.training.prompts import encode_prompt
from tests.serve.test_openai_server import MODEL, live_server

ASK = [{"role": "user", "content": "What is the capital of France?"}]
#: SmolLM2's template, plus Qwen3's switch: enable_thinking false closes an empty thinking block in the prompt
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if boom is defined %}{{ 1 // boom }}{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
THINK = "<think>\\nThe user asks about (the capital of France|geography)\\.\\n</think>\\n\\n(Paris|Lyon)\\."


@pytest.mark.parametrize("text, at_start, want", [
    ("<think>\nplan\n</think>\n\nParis.", False, ("\nplan\n", "\n\nParis.")),
    ("<think>\nplan\n</think>\n\nParis.", True, ("\nplan\n", "\n\nParis.")),
    ("plan</think>Paris.", True, ("plan", "Paris.")),
    ("plan</think>Paris.", False, ("", "plan</think>Paris.")),
    ("still thinking", True, ("still thinking", "")),  # cut by max_tokens
    ("Hi <think>cut", False, ("cut", "Hi ")),
    ("Paris.", False, ("", "Paris.")),
])
def test_split_reasoning(text, at_start, want):
    assert split_reasoning(text, at_start) == want


@pytest.mark.parametrize("pieces, at_start, reasoning_pieces", [
    (["Hello ", "<think>", "\nplan it\n", "</think>", "\n\nParis."], False, [2]),  # qwen3: the tags not counted
    (["plan it\n", "</think>", "\n\nParis."], True, [0]),  # deepseek-r1: from the first token
    (["<think>", "\nplan", " more", "</think>", "Paris."], True, [1, 2]),
    (["Sure. ", "<think>", "\nstill planning"], False, [2]),  # cut inside the reasoning: to the last token
    (["still planning, cut"], True, [0]),
    (["<think>", "</think>", "Paris."], False, []),  # an empty reasoning
    (["</think>", "Paris."], True, []),
    (["Paris.", ""], False, []),  # no reasoning
    (["plan</think>Paris."], False, []),  # qwen3 without <think>: all content
])
def test_reasoning_token_count_is_the_reasoning_texts_tokens(smollm2_pipeline, pieces, at_start, reasoning_pieces):
    """`reasoning_token_count` (the Responses usage's reasoning_tokens) on token ids built piece by piece with the
    real tokenizer: exactly the tokens of the pieces holding the reasoning, without the tags' tokens (as vLLM
    counts; trtllm-serve reports none)."""
    from dflash_trt.serve.reasoning import reasoning_token_count

    tok = smollm2_pipeline.tokenizer
    parts = [tok.encode(p, add_special_tokens=False) for p in pieces]
    ids = [t for part in parts for t in part]
    want = sum(len(parts[i]) for i in reasoning_pieces)
    assert reasoning_token_count(ids, smollm2_pipeline.decode, at_start) == want
    assert reasoning_token_count([], smollm2_pipeline.decode, at_start) == 0


def test_reasoning_tokens_share_a_token_with_a_tag(smollm2_pipeline):
    """Where one token holds both a tag's characters and the reasoning's (SmolLM2 splits the tags into "<", "think",
    ">" and merges ">" with what follows), it counts as reasoning: the count is the tokens holding any of it."""
    from dflash_trt.serve.reasoning import reasoning_token_count

    tok, decode = smollm2_pipeline.tokenizer, smollm2_pipeline.decode
    ids = tok.encode("a <think>>x></think>ok", add_special_tokens=False)  # the reasoning is ">x>"
    assert [decode([i]) for i in ids] == ["a", " <", "think", ">>", "x", "></", "think", ">", "ok"]
    assert reasoning_token_count(ids, decode, False) == 3  # ">>", "x", "></"
    assert reasoning_token_count(ids[:5], decode, False) == 2  # cut after "x": ">>", "x"


@pytest.mark.parametrize("text", ["<think>\nplan a < b\n</think>\n\nParis <3.", "plan</think>Paris.", "no tags <",
                                  "<thi", "Hi <think>cut </thi"])
@pytest.mark.parametrize("at_start", [True, False])
def test_reasoning_stream_joins_to_the_split(text, at_start):
    rng = random.Random(1)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(6, len(text) - 1))))
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s = ReasoningStream(at_start)
        out = [s.delta(p) for p in parts[:-1]] + [s.last(parts[-1])]
        assert ("".join(r for r, _ in out), "".join(c for _, c in out)) == split_reasoning(text, at_start)


def test_reasoning_then_tool_calls_stream_as_the_message():
    tools = ({"name": "get_time", "description": None, "parameters": {"type": "object", "properties": {}}},)
    answers = ChatAnswers(ToolCalling(tools, "auto", None, "hermes"), "deepseek-r1", guided=None)
    text = 'need the time</think>\n\nOne moment. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    message, finish = answers.message(text, "stop")
    assert (message["reasoning_content"], message["content"], finish) == ("need the time", "\n\nOne moment.",
                                                                          "tool_calls")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    for size in (1, 3, 7):
        s = answers.stream()
        parts = [text[i:i + size] for i in range(0, len(text), size)]
        assert s.opening() is None  # "auto": the role waits for the first delta that says something
        deltas = [s.delta(p) for p in parts[:-1]]
        last, got = s.last(parts[-1], "stop")
        deltas = [d for d in deltas + [last] if d]
        # the role with the reasoning's first text, content null there (more may follow), once
        assert deltas[0]["role"] == "assistant" and deltas[0]["content"] is None and deltas[0]["reasoning_content"]
        assert not any("role" in d for d in deltas[1:])
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == message["content"] and got == "tool_calls"
        assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if "id" in c] == ["get_time"]
        assert "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", [])) == "{}"


@pytest.fixture(scope="module")
def thinking(smollm2_pipeline):
    """(OpenAI client, base URL, pipeline) of a server with --reasoning-parser deepseek-r1 and --tool-parser hermes
    whose target's template has Qwen3's enable_thinking switch (the same weights and engine)."""
    from openai import OpenAI

    pipe = copy.copy(smollm2_pipeline)
    pipe.tokenizer = copy.deepcopy(smollm2_pipeline.tokenizer)
    pipe.tokenizer.chat_template = TEMPLATE
    with live_server(pipe, max_batch_size=2, reasoning_parser="deepseek-r1", tool_parser="hermes") as (base, _):
        yield OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120), base, pipe


def runtime_answer(pipe, messages, spec, max_tokens, **template_kwargs):
    ids = encode_prompt(pipe.tokenizer, messages, template_kwargs=template_kwargs)
    [res] = pipe.generate([ids], SamplingParams(max_tokens=max_tokens, guided=spec), mode="ar")
    return ids, res


def joined(chunks):
    chunks = [c for c in chunks if c.choices]
    return ("".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks),
            "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason)


def test_think_tags_split_as_the_runtimes_answer(thinking):
    client, _, pipe = thinking
    _, ref = runtime_answer(pipe, ASK, GuidedDecoding(regex=THINK), 64)
    reasoning, content = split_reasoning(ref.text, at_start=False)
    assert reasoning.startswith("\nThe user asks about") and content in ("\n\nParis.", "\n\nLyon.")
    fmt = {"type": "regex", "regex": THINK}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0,
                                       extra_body={"response_format": fmt})
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == (reasoning, content, "stop")
    assert joined(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0, stream=True,
                                                 extra_body={"response_format": fmt})) == (reasoning, content, "stop")


def test_deepseek_r1_reads_an_answer_without_tags_as_reasoning(thinking):
    client, _, pipe = thinking
    _, ref = runtime_answer(pipe, ASK, None, 16)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == (ref.text, None, ref.finish_reason)
    assert joined(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0,
                                                 stream=True)) == (ref.text, "", ref.finish_reason)


def test_a_json_answer_is_never_split(thinking):
    client, _, pipe = thinking
    schema = {"type": "object", "properties": {"q": {"enum": ["<think>secret</think>tail"]}}, "required": ["q"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "q", "schema": schema}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=32, temperature=0, response_format=fmt)
    m = r.choices[0].message
    assert m.reasoning_content is None and json.loads(m.content) == {"q": "<think>secret</think>tail"}
    assert joined(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=32, temperature=0, stream=True,
                                                 response_format=fmt)) == ("", m.content, "stop")


def test_a_forced_tool_call_is_not_reasoning(thinking):
    client, _, pipe = thinking
    tool = {"type": "function", "function": {"name": "capital", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=32, temperature=0, tools=[tool],
                                       tool_choice={"type": "function", "function": {"name": "capital"}})
    m = r.choices[0].message
    assert m.reasoning_content is None and m.content is None
    assert set(json.loads(m.tool_calls[0].function.arguments)) == {"city"}


def test_chat_template_kwargs_reach_the_template(thinking):
    client, base, pipe = thinking
    ids, ref = runtime_answer(pipe, ASK, None, 12, enable_thinking=False)
    assert "<think>\n\n</think>" in pipe.tokenizer.decode(ids)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(ids) > len(encode_prompt(pipe.tokenizer, ASK))
    assert r.choices[0].message.reasoning_content == ref.text  # deepseek-r1: no </think> in the answer
    for kwargs, message in ((["x"], "chat_template_kwargs"), ({"tools": []}, "chat_template_kwargs holds 'tools'"),
                            ({"add_generation_prompt": False}, "holds 'add_generation_prompt'"),
                            ({"self": 1}, "holds 'self'"), ({"conversations": []}, "holds 'conversations'"),
                            ({"boom": 0}, "the target's chat template failed on this request (ZeroDivisionError"),
                            ({"boom": "x"}, "the target's chat template failed on this request (TypeError")):
        bad = httpx.post(base + "/v1/chat/completions", timeout=60,
                         json={"model": MODEL, "messages": ASK, "max_tokens": 2, "chat_template_kwargs": kwargs})
        assert bad.status_code == 400 and message in bad.json()["error"]["message"], bad.text
        assert bad.json()["error"]["param"] == "chat_template_kwargs"


def test_the_cli_offers_every_reasoning_parser():
    from dflash_trt.cli.serve import serve

    [option] = [p for p in serve.params if p.name == "reasoning_parser"]
    assert tuple(option.type.choices) == REASONING_PARSERS


def test_streams_with_usage(thinking):
    """include_usage (and continuous_usage_stats) with a reasoning parser and with tools: the usage chunk and
    [DONE] come after the answer's chunks, and the usage equals the non-streamed answer's."""
    client, _, _ = thinking
    tool = {"type": "function", "function": {"name": "capital", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}
    for extra in ({}, {"tools": [tool], "tool_choice": "required"}, {"tools": [tool], "tool_choice": "none"}):
        whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0, **extra)
        for options in ({"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}):
            chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0,
                                                         stream=True, stream_options=options, **extra))
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
            reasoning, content, finish = joined(chunks)
            assert (reasoning or None, content or None, finish) == (
                whole.choices[0].message.reasoning_content, whole.choices[0].message.content,
                whole.choices[0].finish_reason)


def test_chat_usage_counts_the_reasoning_tokens(thinking):
    """With a --reasoning-parser, chat's usage has completion_tokens_details.reasoning_tokens (as OpenAI's and vLLM's,
    the Responses usage's count: `reasoning_token_count`), summed over the choices, in the streamed usage chunk
    too: deepseek-r1 reads an answer without </think> as all reasoning, the regex answer has it between its tags
    (read as qwen3 reads), and a JSON answer (never split) has none."""
    from dflash_trt.serve.reasoning import reasoning_token_count

    client, _, pipe = thinking
    _, plain = runtime_answer(pipe, ASK, None, 16)
    _, tagged = runtime_answer(pipe, ASK, GuidedDecoding(regex=THINK), 64)
    want = reasoning_token_count(tagged.token_ids, pipe.decode, at_start=False)
    assert 0 < want < len(tagged.token_ids) - 3
    schema = {"type": "object", "properties": {"q": {"enum": ["<think>x</think>"]}}, "required": ["q"]}
    for kwargs, tokens, reasoning in (
            ({"max_tokens": 16}, len(plain.token_ids), len(plain.token_ids)),
            ({"max_tokens": 16, "n": 2}, 2 * len(plain.token_ids), 2 * len(plain.token_ids)),
            ({"max_tokens": 64, "extra_body": {"response_format": {"type": "regex", "regex": THINK}}},
             len(tagged.token_ids), want),
            ({"max_tokens": 32, "response_format": {"type": "json_schema", "json_schema": {"name": "q",
                                                                                           "schema": schema}}},
             None, 0)):
        r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, **kwargs)
        assert tokens is None or r.usage.completion_tokens == tokens
        assert r.usage.completion_tokens_details.reasoning_tokens == reasoning, kwargs
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}, **kwargs))
        assert chunks[-1].choices == [] and chunks[-1].usage == r.usage
        assert all(c.usage is None for c in chunks[:-1])
