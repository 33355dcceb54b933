"""Tool calling over the OpenAI server (real HTTP on 127.0.0.1, the real `openai` client): a named function and
tool_choice "required" give exactly the runtime's greedy tokens under the call's grammar, as tool calls; "auto"
parses the Hermes format (`--tool-parser hermes`) and is refused without a parser; streamed, calls come as they
are written (the name first, then the arguments) and the deltas join to the non-streamed message; bad tools /
tool_choice are 400s naming the field, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from dflash_trt.runtime.guided import GuidedDecoding
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.serve.tool_stream import read_answer
from dflash_trt.serve.tools import TOOL_PARSERS, required_schema
from dflash_trt.training.prompts import encode_prompt
from tests.serve.test_openai_server import MODEL, live_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
#: an answer in the Hermes format, forced by a regex, for "auto" with the hermes parser
HERMES = ('Let me check\\.\\n<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Lyon)", '
          '"unit": "celsius"\\}\\}\\n</tool_call>')


def reference(pipe, messages, tools, spec: GuidedDecoding | None, max_tokens: int):
    """The runtime's greedy answer (autoregressive) to `messages` rendered with `tools`, under `spec`."""
    ids = encode_prompt(pipe.tokenizer, messages, tools=tools)
    [res] = pipe.generate([ids], SamplingParams(max_tokens=max_tokens, guided=spec), mode="ar")
    return res


def joined(chunks) -> tuple[str, dict[int, dict], str | None, list]:
    """(content, {index: {"id", "name", "arguments"}}, finish_reason, chunks) of one streamed choice."""
    chunks = [c for c in chunks if c.choices]
    content, calls, finish = "", {}, None
    for c in chunks:
        d = c.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            call = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = t.id or call["id"]
            if t.function is not None:
                call["name"] += t.function.name or ""
                call["arguments"] += t.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    return content, calls, finish, chunks


def streamed_as_written(chunks) -> bool:
    """Whether each call of a stream came as it was written: its id, type and name in its first delta (and only
    there), its arguments over more than one chunk."""
    seen, arg_chunks = set(), 0
    for c in chunks:
        for t in c.choices[0].delta.tool_calls or []:
            first = t.index not in seen
            seen.add(t.index)
            if first != (t.id is not None) or first != (t.type == "function") or first != bool(t.function.name):
                return False
            arg_chunks += not first
    return bool(seen) and arg_chunks >= len(seen)


@pytest.fixture(scope="module")
def hermes(smollm2_pipeline):
    """(base URL, app) of a server started with --tool-parser hermes."""
    with live_server(smollm2_pipeline, max_batch_size=4, tool_parser="hermes") as served:
        yield served


@pytest.fixture(scope="module")
def hermes_client(hermes):
    from openai import OpenAI

    return OpenAI(base_url=hermes[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_named_function_gives_the_runtimes_arguments(client, smollm2_pipeline):
    ref = reference(smollm2_pipeline, ASK, [WEATHER], GuidedDecoding(json=WEATHER["function"]["parameters"]), 48)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=48, temperature=0, tools=[WEATHER, TIME],
                                       tool_choice=choice)
    c = r.choices[0]
    assert c.message.content is None and c.finish_reason == "stop" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert call.function.arguments == ref.text and json.loads(ref.text)["unit"] in ("celsius", "fahrenheit")
    assert r.usage.completion_tokens == len(ref.token_ids)
    content, calls, finish, chunks = joined(client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=48, temperature=0, tools=[WEATHER, TIME], tool_choice=choice,
        stream=True))
    assert content == "" and finish == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == ref.text
    assert chunks[0].choices[0].delta.tool_calls[0].id == calls[0]["id"]  # the id comes with the name, first


@pytest.mark.parametrize("parallel", [None, False])
def test_required_gives_the_runtimes_calls(client, smollm2_pipeline, parallel):
    tools = [WEATHER, TIME]
    spec = GuidedDecoding(json=required_schema(tuple(t["function"] for t in tools), parallel is not False))
    ref = reference(smollm2_pipeline, ASK, tools, spec, 64)
    items = json.loads(ref.text)
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0, tools=tools,
                                       tool_choice="required", **extra)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        (it["name"], it["parameters"]) for it in items]
    assert len({t.id for t in c.message.tool_calls}) == len(items) >= 1
    content, calls, finish, chunks = joined(client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=64, temperature=0, tools=tools, tool_choice="required", stream=True,
        **extra))
    assert content == "" and finish == "tool_calls" and all(c.choices[0].delta.tool_calls for c in chunks[1:-1])
    assert streamed_as_written(chunks)
    assert [(v["name"], v["arguments"]) for _, v in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_a_streamed_answer_that_is_calls_opens_with_content_null(server, client):
    """As OpenAI streams an answer that is tool calls: its first chunk has the role, `content: null` (the
    message's content) and the first call's id and name; no later chunk carries content or the role. The openai
    SDK's accumulated message has content None, as the non-streamed one."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 64, "temperature": 0, "tools": [WEATHER],
            "tool_choice": "required"}
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.message.content is None and whole.finish_reason == "tool_calls"
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines() if line.startswith("data: {")]
    [call] = deltas[0].pop("tool_calls")
    assert deltas[0] == {"role": "assistant", "content": None} and call["function"]["name"] == "get_weather"
    assert not any("role" in d or "content" in d for d in deltas[1:])
    with client.chat.completions.stream(**body) as s:
        final = s.get_final_completion().choices[0]
    assert final.message.content is None and final.message.tool_calls[0].function.arguments == (
        whole.message.tool_calls[0].function.arguments)


def test_required_with_nested_models(client, smollm2_pipeline):
    """Tools whose parameters refer to their own $defs (pydantic's nested models, `openai.pydantic_function_tool`)."""
    loc = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
           "required": ["city", "country"], "additionalProperties": False}
    nested = {"type": "function", "function": {"name": "locate", "parameters": {
        "type": "object", "$defs": {"Loc": loc}, "properties": {"where": {"$ref": "#/$defs/Loc"}},
        "required": ["where"], "additionalProperties": False}}}
    tools = [TIME, nested]
    spec = GuidedDecoding(json=required_schema(tuple(t["function"] for t in tools), parallel=False))
    items = json.loads(reference(smollm2_pipeline, ASK, tools, spec, 96).text)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=96, temperature=0, tools=tools,
                                       tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in r.choices[0].message.tool_calls] == [
        (it["name"], it["parameters"]) for it in items]
    for it in items:
        if it["name"] == "locate":
            assert set(it["parameters"]["where"]) == {"city", "country"}


def test_required_cut_by_max_tokens_keeps_its_calls_as_far_as_they_went(client, smollm2_pipeline):
    """Cut before a call's name is whole: the text; after: the call, its arguments as far as they went (the JSON
    unfinished, as OpenAI's); after the call is whole: the call; finish_reason "length". Streamed, the same."""
    pipe = smollm2_pipeline
    spec = GuidedDecoding(json=required_schema((WEATHER["function"],)))
    full = reference(pipe, ASK, [WEATHER], spec, 64)
    cuts = {"text": 4}
    for n in range(1, len(full.token_ids)):
        content, calls = read_answer("required", pipe.decode(full.token_ids[:n]))
        if calls and calls[0][1] and not calls[0][1].endswith("}"):
            cuts.setdefault("in the arguments", n)
        if calls and calls[0][1].endswith("}"):
            cuts.setdefault("whole", n)
    assert cuts["text"] < cuts["in the arguments"] < cuts["whole"] < len(full.token_ids) - 1, cuts
    for where, n in cuts.items():
        want_content, want_calls = read_answer("required", pipe.decode(full.token_ids[:n]))
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=n, temperature=0, tools=[WEATHER],
                                           tool_choice="required")
        c = r.choices[0]
        assert c.finish_reason == "length" and c.message.content == want_content, where
        assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []] == want_calls, where
        if where == "text":
            assert c.message.content.startswith("[") and not want_calls
        else:
            assert want_calls[0][0] == "get_weather"
        content, calls, finish, _ = joined(client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=n, temperature=0, tools=[WEATHER], tool_choice="required",
            stream=True))
        assert (content, finish) == (want_content or "", "length")
        assert [(v["name"], v["arguments"]) for v in calls.values()] == want_calls


def test_the_openai_stream_helper_reads_calls_as_they_are_written(client, smollm2_pipeline):
    """The openai SDK's `chat.completions.stream` (its accumulation, its argument delta events, its parsing of a
    strict tool's arguments) over a streamed "required" call: the final completion is the non-streamed one."""
    tool = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    body = {"model": MODEL, "messages": ASK, "max_tokens": 64, "temperature": 0, "tools": [tool],
            "tool_choice": "required"}
    whole = client.chat.completions.create(**body).choices[0]
    with client.chat.completions.stream(**body) as s:
        events = list(s)
        final = s.get_final_completion().choices[0]
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    arguments = whole.message.tool_calls[0].function.arguments
    assert len(deltas) > 1 and "".join(e.arguments_delta for e in deltas) == arguments
    assert all(e.name == "get_weather" for e in deltas)  # the name came first, with the call's first delta
    [done] = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert done.parsed_arguments == json.loads(arguments)
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    [call] = final.message.tool_calls
    assert (call.function.name, call.function.arguments) == (
        whole.message.tool_calls[0].function.name, whole.message.tool_calls[0].function.arguments)
    assert call.id.startswith("call_") and call.type == "function"


def test_auto_needs_a_tool_parser(server, client):
    for body in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        r = httpx.post(server[0] + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert "--tool-parser (hermes, qwen3, llama3_json)" in r.json()["error"]["message"]
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0, tools=[WEATHER],
                                       tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_auto_reads_hermes_tool_calls(hermes_client, smollm2_pipeline):
    fmt = {"type": "regex", "regex": HERMES}
    ref = reference(smollm2_pipeline, ASK, [WEATHER], GuidedDecoding(regex=HERMES), 96)
    assert ref.text.startswith("Let me check.\n<tool_call>") and ref.finish_reason == "stop", ref
    r = hermes_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=96, temperature=0, tools=[WEATHER],
                                              extra_body={"response_format": fmt})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    [call] = c.message.tool_calls
    want = json.loads(ref.text.split("<tool_call>")[1].split("</tool_call>")[0])
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == want["arguments"]
    content, calls, finish, chunks = joined(hermes_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=96, temperature=0, tools=[WEATHER], stream=True,
        extra_body={"response_format": fmt}))
    assert (content, finish) == ("Let me check.", "tool_calls") and streamed_as_written(chunks)
    # the role comes with the first text: content that is text opens with text, not null
    opening = chunks[0].choices[0].delta
    assert opening.role == "assistant" and opening.content and "Let me check.".startswith(opening.content)
    first_call = next(i for i, c in enumerate(chunks) if c.choices[0].delta.tool_calls)
    assert all(not c.choices[0].delta.content for c in chunks[first_call:])  # the content came before the call
    assert [(v["name"], v["arguments"]) for v in calls.values()] == [("get_weather", call.function.arguments)]


def test_a_call_cut_by_a_stop_string_is_not_tool_calls(hermes_client):
    """A stop string that cuts a call after its name: the call as far as it was sure (its arguments not JSON), and
    finish_reason "stop", not "tool_calls" (the call is not usable); streamed, the same."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 96, "temperature": 0, "tools": [WEATHER],
            "stop": ['"unit"'], "extra_body": {"response_format": {"type": "regex", "regex": HERMES}}}
    c = hermes_client.chat.completions.create(**body).choices[0]
    assert c.finish_reason == "stop" and c.message.content == "Let me check."
    [call] = c.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments in (
        '{"city": "Paris", ', '{"city": "Lyon", ')
    content, calls, finish, _ = joined(hermes_client.chat.completions.create(**body, stream=True))
    assert (content, finish) == ("Let me check.", "stop")
    assert [(v["name"], v["arguments"]) for v in calls.values()] == [("get_weather", call.function.arguments)]


def test_auto_reads_llama3_json_tool_calls(smollm2_pipeline):
    from openai import OpenAI

    regex = '\\{"name": "get_weather", "parameters": \\{"city": "(Paris|Lyon)", "unit": "celsius"\\}\\}'
    ref = reference(smollm2_pipeline, ASK, [WEATHER], GuidedDecoding(regex=regex), 64)
    assert ref.finish_reason == "stop", ref
    with live_server(smollm2_pipeline, max_batch_size=2, tool_parser="llama3_json") as (base, _):
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        fmt = {"type": "regex", "regex": regex}
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0, tools=[WEATHER],
                                           extra_body={"response_format": fmt})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        [call] = c.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather", json.loads(ref.text)["parameters"])
        content, calls, finish, chunks = joined(client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=64, temperature=0, tools=[WEATHER], stream=True,
            extra_body={"response_format": fmt}))
        assert (content, finish) == ("", "tool_calls") and streamed_as_written(chunks)
        assert [(v["name"], v["arguments"]) for v in calls.values()] == [("get_weather", call.function.arguments)]
        plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0,
                                               tools=[WEATHER])  # no JSON: the answer is the content
        assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
        # JSON with a "name" but no arguments key after it, or a name that is no tool's: data, the content
        for data in ('\\{"name": "get_weather", "city": "(Paris|Lyon)"\\}',
                     '\\{"name": "(Alice|Bob)", "parameters": \\{"age": 30\\}\\}'):
            extra = {"response_format": {"type": "regex", "regex": data}}
            r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=32, temperature=0,
                                               tools=[WEATHER], extra_body=extra)
            c = r.choices[0]
            assert c.finish_reason == "stop" and c.message.tool_calls is None and json.loads(c.message.content)
            content, calls, finish, _ = joined(client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=32, temperature=0, tools=[WEATHER], stream=True,
                extra_body=extra))
            assert (content, calls, finish) == (c.message.content, {}, "stop")
        # a stop string that cuts the call: not "tool_calls"
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0, tools=[WEATHER],
                                           stop=['"unit"'], extra_body={"response_format": fmt})
        c = r.choices[0]
        assert c.finish_reason == "stop" and c.message.content is None
        assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [
            ("get_weather", '{"city": "%s", ' % json.loads(ref.text)["parameters"]["city"])]


def test_auto_without_a_call_is_the_plain_answer(hermes_client):
    plain = hermes_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0,
                                                  tools=[WEATHER], tool_choice="none")
    r = hermes_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0, tools=[WEATHER])
    assert "<tool_call>" not in plain.choices[0].message.content
    assert r.choices[0].message.content == plain.choices[0].message.content and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == plain.choices[0].finish_reason
    content, calls, finish, _ = joined(hermes_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=24, temperature=0, tools=[WEATHER], stream=True))
    assert (content, calls, finish) == (plain.choices[0].message.content, {}, plain.choices[0].finish_reason)


def test_a_conversation_with_tool_results(client, smollm2_pipeline):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, tools=[WEATHER],
                                       tool_choice="none")
    rendered = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call_1"}]
    ids = encode_prompt(smollm2_pipeline.tokenizer, rendered, tools=[WEATHER])
    assert r.usage.prompt_tokens == len(ids)
    [ref] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=8), mode="ar")
    assert r.choices[0].message.content == ref.text


def bad(fn_name="get_weather", **fn):
    return [{"type": "function", "function": {"name": fn_name, **fn}}]


@pytest.mark.parametrize("body, param, message", [
    ({"tools": {"name": "f"}}, "tools", 'tools: give a list of {"type": "function"'),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tool 0 is not {\"type\": \"function\""),
    ({"tools": bad("get weather"), "tool_choice": "required"}, "tools", "tool 0 has the name 'get weather'"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "two tools are named 'get_weather'"),
    ({"tools": bad(parameters=False), "tool_choice": "none"}, "tools", "tool 'get_weather' has parameters false"),
    ({"tools": bad(parameters="x"), "tool_choice": "required"}, "tools",
     "tool 'get_weather' has parameters \"x\"; a function's parameters are a JSON schema of type object"),
    ({"tools": bad(parameters={"type": "object", "allOf": [{"type": "object"}]}), "tool_choice": "required"}, "tools",
     "tool 'get_weather' parameters: guided decoding: the JSON schema keyword 'allOf'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", 'tool_choice must be "none", "auto"'),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "names the function 'get_time', which is not in tools (get_weather)"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot have a response_format too"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos",
     "ignore_eos and tool_choice do not go together"),
    ({"functions": [WEATHER["function"]]}, "functions", "(use tools)"),
    ({"tools": [WEATHER], "tool_choice": "none", "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"tools": [WEATHER], "tool_choice": "none", "messages": ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages", 'tool call 0 is not {"function": {"name": "...", "arguments": "<JSON text>"}}, as OpenAI writes one'),
    ({"tools": [WEATHER], "tool_choice": "none", "messages": ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "21 C"}]},
     "messages[2].tool_call_id", "messages[2].tool_call_id is missing; a tool message answers one tool call: give the "
     'id of that call in the assistant message\'s tool_calls, e.g. "tool_call_id": "call_1"'),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": 1, "content": "21 C"}]}, "messages[1].tool_call_id",
     "messages[1].tool_call_id is 1, not a string; a tool message answers one tool call: give the id of that call"),
    ({"tools": bad(parameters={"type": "string"}), "tool_choice": "none"}, "tools",
     "tool 'get_weather' has parameters {\"type\": \"string\"}; a function's parameters are a JSON schema of type "
     "object"),
    ({"tools": bad(parameters={"type": "object", "properties": {"a": {"type": "objekt"}}}),
      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tools",
     "tools: tool 'get_weather' parameters: guided decoding: the json does not compile: "),
    ({"tools": [WEATHER, *bad("get_time", parameters={"type": "object", "properties": {"a": {"$ref": "#/$defs/no"}}})],
      "tool_choice": "required"}, "tools", "tools: tool 'get_time' parameters: guided decoding: the json does not "),
    ({"tools": [WEATHER], "tool_choice": "required", "stop": ["Paris"]}, "stop",
     "stop and tool_choice 'required' do not go together: a stop would cut the call's JSON"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "stop_token_ids": [11]}, "stop_token_ids", "stop_token_ids and tool_choice {'type': 'function'"),
    ({"tools": bad(description="\ud800"), "tool_choice": "none"}, "tools", "tools (a tool's text) holds"),
    ({"tools": bad(strict="yes"), "tool_choice": "none"}, "tools",
     "tool 'get_weather' has strict \"yes\"; give true, false or null"),
    # a misspelt field was dropped: "paramters" left the function without its schema, and no word said so
    ({"tools": bad(paramters={"type": "object"}), "tool_choice": "auto"}, "tools",
     "tools: tool 0 has the function field 'paramters', which a function tool does not take (it takes name, "
     "description, parameters, strict); did you mean 'parameters'?"),
    ({"tools": [{**WEATHER, "fuction": {}}], "tool_choice": "auto"}, "tools",
     "tool 0 has the field 'fuction', which a function tool does not take (it takes type, function); did you mean "
     "'function'?"),
    ({"tools": [WEATHER, *bad("get_time", examples=[])], "tool_choice": "none"}, "tools",
     "tool 1 has the function field 'examples', which a function tool does not take (it takes name, description, "
     "parameters, strict)"),
])
def test_bad_tools_are_a_400_naming_the_field(server, client, body, param, message):
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=60, headers={"Content-Type": "application/json"},
                   content=json.dumps({"model": MODEL, "messages": ASK, "max_tokens": 4, **body}))  # \ud800 escaped
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2).usage.completion_tokens == 2


def test_completions_refuses_tools(server):
    r = httpx.post(server[0] + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "tools": [WEATHER]})
    assert r.status_code == 400 and "tool calling is on /v1/chat/completions" in r.json()["error"]["message"]


def test_the_cli_offers_every_tool_parser():
    from dflash_trt.cli.serve import serve

    [option] = [p for p in serve.params if p.name == "tool_parser"]
    assert tuple(option.type.choices) == TOOL_PARSERS


#: a chat template that renders tools and tool calls, as Qwen3's and Hermes' do (written for this test)
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n</tool_call>{% endfor %}'
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tools_template_server(smollm2_pipeline):
    """(base URL, app) of a server whose target's chat template renders tools (the same weights and engine)."""
    import copy

    pipe = copy.copy(smollm2_pipeline)
    pipe.tokenizer = copy.deepcopy(smollm2_pipeline.tokenizer)
    pipe.tokenizer.chat_template = TOOLS_TEMPLATE
    with live_server(pipe, max_batch_size=2, tool_parser="qwen3") as served:
        yield served, pipe


def test_a_template_that_renders_tools_gets_them(tools_template_server):
    (base, _), pipe = tools_template_server
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, tools=[WEATHER], tool_choice="none")
    with_tools = encode_prompt(pipe.tokenizer, ASK, tools=[WEATHER])
    assert plain.usage.prompt_tokens == len(with_tools) > len(encode_prompt(pipe.tokenizer, ASK)) + 20
    assert '"name": "get_weather"' in pipe.tokenizer.decode(with_tools)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=1, tools=[WEATHER], tool_choice="none")
    ids = encode_prompt(pipe.tokenizer, history[:1] + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        history[2]], tools=[WEATHER])
    text = pipe.tokenizer.decode(ids)
    assert r.usage.prompt_tokens == len(ids)
    # the arguments reach the template as an object (written out once), not as a quoted JSON string
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text and '\\"city\\"' not in text
