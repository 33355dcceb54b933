"""OpenAI's Responses API over the server (real HTTP on 127.0.0.1, the real `openai` client): `POST /v1/responses`
answers the runtime's own greedy tokens for the conversation it amounts to (instructions, input items, a previous
response), as a Response OpenAI's own types accept; streamed, its events are named, numbered, valid, and end with
the Response a non-streamed request gets; function calls, JSON formats, reasoning items and logprobs as on chat;
stored responses are retrieved, continued and deleted; bad requests are 400s / 404s naming the field, and the
server keeps serving."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from dflash_trt.runtime.guided import GuidedDecoding
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.serve.chat import ChatAnswers
from dflash_trt.serve.responses import (
    ResponseEvents,
    ResponsesRequest,
    input_messages,
    response_object,
    usage_of,
    whole_response,
)
from dflash_trt.serve.tools import ToolCalling
from dflash_trt.training.prompts import encode_prompt
from tests.serve.test_openai_server import MODEL, live_server

ASK = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
#: JSON nested 500 levels deep
NESTED: dict = {}
_level = NESTED
for _ in range(500):
    _level["a"] = {}
    _level = _level["a"]
#: fields that differ between two requests for the same answer
VARYING = ("id", "created_at", "call_id", "metrics")


def reference(pipe, messages, max_tokens: int, spec: GuidedDecoding | None = None, tools=None):
    """(prompt ids, the runtime's greedy answer (autoregressive)) to chat `messages`."""
    ids = encode_prompt(pipe.tokenizer, messages, tools=tools)
    [res] = pipe.generate([ids], SamplingParams(max_tokens=max_tokens, guided=spec), mode="ar")
    return ids, res


def post(base: str, body: dict) -> dict:
    r = httpx.post(base + "/v1/responses", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def events(base: str, body: dict) -> list[dict]:
    """The streamed events of `body`, each checked: its `event:` name is its type, numbered from 0, and valid as
    OpenAI's own event type."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    out, name = [], None
    with httpx.stream("POST", base + "/v1/responses", json={"model": MODEL, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == name and event["sequence_number"] == len(out)
                adapter.validate_python(event)
                out.append(event)
    return out


def strip(obj):
    """`obj` without the fields that differ between two requests for the same answer (ids, times)."""
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if k not in VARYING}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    return obj


def check_stream(base: str, body: dict, whole: dict) -> list[dict]:
    """Stream `body`: its deltas join to its items, its last event's Response is `whole` (ids and times aside)."""
    got = events(base, body)
    final = got[-1]["response"]
    assert got[0]["type"] == "response.created" and got[1]["type"] == "response.in_progress"
    assert got[-1]["type"] == ("response.incomplete" if whole["status"] == "incomplete" else "response.completed")
    assert strip(final) == strip(whole)
    for index, item in enumerate(final["output"]):
        mine = [e for e in got if e.get("output_index") == index]
        assert mine[0]["type"] == "response.output_item.added"
        assert mine[-1] == {"type": "response.output_item.done", "sequence_number": mine[-1]["sequence_number"],
                            "output_index": index, "item": item}
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        assert deltas == (item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"])
    return got


@pytest.fixture(scope="module")
def served(server, smollm2_pipeline):
    """(base URL, OpenAI client, pipeline)."""
    from openai import OpenAI

    return server[0], OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120), \
        smollm2_pipeline


def test_a_text_answer_is_the_targets_greedy_answer(served):
    from openai.types.responses import Response

    base, client, pipe = served
    ids, ref = reference(pipe, [{"role": "system", "content": "Answer in one sentence."},
                                {"role": "user", "content": ASK}], 48)
    raw = post(base, {"input": ASK, "instructions": "Answer in one sentence.", "max_output_tokens": 48,
                      "temperature": 0})
    Response.model_validate(raw)  # OpenAI's own type accepts it
    assert ref.finish_reason == "stop" and raw["status"] == "completed" and raw["incomplete_details"] is None
    [item] = raw["output"]
    assert (item["type"], item["role"], item["status"]) == ("message", "assistant", "completed")
    assert item["content"] == [{"type": "output_text", "text": pipe.decode(ref.token_ids), "annotations": []}]
    assert raw["usage"] == usage_of(len(ids), len(ref.token_ids))
    assert raw["instructions"] == "Answer in one sentence." and raw["max_output_tokens"] == 48
    assert raw["metrics"]["acceptance_length"] >= 1
    got = client.responses.create(model=MODEL, input=ASK, instructions="Answer in one sentence.",
                                  max_output_tokens=48, temperature=0)
    assert got.output_text == pipe.decode(ref.token_ids)
    check_stream(base, {"input": ASK, "instructions": "Answer in one sentence.", "max_output_tokens": 48,
                        "temperature": 0}, raw)


def test_max_output_tokens_cuts_the_answer_incomplete(served):
    base, _, pipe = served
    # text parts are joined with newlines, as on chat (vLLM's joining)
    ids, ref = reference(pipe, [{"role": "user", "content": "Write a long story about a\ndragon."}], 5)
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Write a long story about a"},
                                                   {"type": "input_text", "text": "dragon."}]}],
            "max_output_tokens": 5, "temperature": 0}
    raw = post(base, body)
    assert ref.finish_reason == "length" and len(ref.token_ids) == 5
    assert (raw["status"], raw["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert raw["output"][0]["status"] == "incomplete"
    assert raw["output"][0]["content"][0]["text"] == pipe.decode(ref.token_ids)
    assert raw["usage"]["output_tokens"] == 5 and raw["usage"]["input_tokens"] == len(ids)
    check_stream(base, body, raw)


def test_previous_response_id_continues_and_stored_responses_are_kept(served):
    base, client, pipe = served
    first = client.responses.create(model=MODEL, input=ASK, instructions="Be brief.", max_output_tokens=32,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="And the capital of Italy?", previous_response_id=first.id,
                                     max_output_tokens=32, temperature=0)
    # the first answer and the new input follow the first input; the first instructions do not carry over
    _, ref = reference(pipe, [{"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "And the capital of Italy?"}], 32)
    assert second.output_text == pipe.decode(ref.token_ids) and second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    client.responses.delete(first.id)
    gone = httpx.get(f"{base}/v1/responses/{first.id}")
    assert gone.status_code == 404 and first.id in gone.json()["error"]["message"]
    again = httpx.post(base + "/v1/responses", json={"input": "Hi", "previous_response_id": first.id})
    assert again.status_code == 404 and again.json()["error"]["param"] == "previous_response_id"
    assert httpx.delete(f"{base}/v1/responses/{first.id}").status_code == 404
    assert post(base, {"input": "Hi", "store": None, "stream": None, "max_output_tokens": 2})["store"] is True
    wrong = httpx.post(f"{base}/v1/responses/{second.id}", json={})
    assert wrong.status_code == 405 and wrong.headers["allow"] == "DELETE, GET"
    assert "use DELETE, GET" in wrong.json()["error"]["message"]
    streamed_back = httpx.get(f"{base}/v1/responses/{second.id}?stream=true")
    assert streamed_back.status_code == 400 and streamed_back.json()["error"]["param"] == "stream"
    unstored = post(base, {"input": "Hi", "store": False, "max_output_tokens": 2})
    assert unstored["store"] is False and httpx.get(f"{base}/v1/responses/{unstored['id']}").status_code == 404
    # a streamed response is stored too, and continues as the non-streamed one would
    streamed = events(base, {"input": ASK, "max_output_tokens": 32, "temperature": 0})[-1]["response"]
    assert strip(httpx.get(f"{base}/v1/responses/{streamed['id']}").json()) == strip(streamed)
    follow = post(base, {"input": "And the capital of Italy?", "previous_response_id": streamed["id"],
                         "max_output_tokens": 32, "temperature": 0})
    assert follow["output"][0]["content"][0]["text"] == second.output_text


def test_input_items_are_listed(served):
    base, client, _ = served
    given = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "Sunny"}]
    rid = post(base, {"input": given, "max_output_tokens": 4})["id"]
    listed = list(client.responses.input_items.list(rid, order="asc"))  # the client pages through them
    assert [(it.type, getattr(it, "role", None)) for it in listed] == [
        ("message", "developer"), ("message", "user"), ("function_call", None), ("function_call_output", None)]
    assert listed[0].content[0].text == "Be brief." and listed[2].arguments == '{"city": "Paris"}'
    assert len({it.id for it in listed}) == 4
    page = httpx.get(f"{base}/v1/responses/{rid}/input_items", params={"limit": 2}).json()  # newest first
    assert [it["id"] for it in page["data"]] == [listed[3].id, listed[2].id] and page["has_more"] is True
    from openai.types.responses import ResponseItem
    from pydantic import TypeAdapter

    for item in page["data"] + httpx.get(f"{base}/v1/responses/{rid}/input_items").json()["data"]:
        TypeAdapter(ResponseItem).validate_python(item)  # OpenAI's own item types accept them
    rest = httpx.get(f"{base}/v1/responses/{rid}/input_items", params={"after": page["last_id"]}).json()
    assert [it["id"] for it in rest["data"]] == [listed[1].id, listed[0].id] and rest["has_more"] is False
    text = post(base, {"input": "Hi", "max_output_tokens": 2})["id"]
    [only] = httpx.get(f"{base}/v1/responses/{text}/input_items").json()["data"]
    assert (only["role"], only["content"]) == ("user", [{"type": "input_text", "text": "Hi"}])
    for params, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "x"}, "after"),
                          ({"limit": "many"}, "limit")):
        bad = httpx.get(f"{base}/v1/responses/{rid}/input_items", params=params)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    assert httpx.get(f"{base}/v1/responses/resp_nope/input_items").status_code == 404
    empty = httpx.get(f"{base}/v1/responses/{rid}/input_items", params={"after": rest["last_id"]}).json()
    assert (empty["data"], empty["first_id"], empty["has_more"]) == ([], "", False)


def test_a_response_in_progress_then_cancelled_by_its_client(served):
    """GET shows a streamed response in progress; its client leaving makes it cancelled, which cannot be continued."""
    base, _, _ = served
    body = {"model": MODEL, "input": "Write a very long story about a dragon and a knight.", "stream": True,
            "max_output_tokens": 2000, "temperature": 0}
    with httpx.stream("POST", base + "/v1/responses", json=body, timeout=120) as r:
        lines = r.iter_lines()  # kept: an iterator dropped would close the connection
        first = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])
        rid = first["response"]["id"]
        assert first["type"] == "response.created" and first["response"]["status"] == "in_progress"
        assert httpx.get(f"{base}/v1/responses/{rid}").json()["status"] == "in_progress"
        received = ""
        for line in lines:
            if line.startswith("data: ") and '"response.output_text.delta"' in line:
                received += json.loads(line[len("data: "):])["delta"]
                if len(received) > 20:
                    break
    for _ in range(600):  # the server notices the disconnect at the next tokens
        got = httpx.get(f"{base}/v1/responses/{rid}").json()
        if got["status"] != "in_progress":
            break
        time.sleep(0.05)
    assert got["status"] == "cancelled"
    [item] = got["output"]  # what it was sent so far is kept
    assert item["status"] == "incomplete" and item["content"][0]["text"].startswith(received) and received
    refused = httpx.post(base + "/v1/responses", json={"input": "Go on.", "previous_response_id": rid})
    assert refused.status_code == 400 and "cancelled" in refused.json()["error"]["message"]


def test_a_response_deleted_while_in_progress_stays_deleted(served):
    base, _, _ = served
    body = {"model": MODEL, "input": ASK, "stream": True, "max_output_tokens": 24, "temperature": 0}
    with httpx.stream("POST", base + "/v1/responses", json=body, timeout=120) as r:
        lines = r.iter_lines()
        rid = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])["response"]["id"]
        assert httpx.delete(f"{base}/v1/responses/{rid}").json()["deleted"] is True
        assert [line for line in lines if line.startswith("event: ")][-1] == "event: response.completed"
    assert httpx.get(f"{base}/v1/responses/{rid}").status_code == 404


def test_chat_refuses_fields_nested_too_deeply(served):
    base, _, _ = served
    r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "chat_template_kwargs": {"x": NESTED}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert "nests more than" in r.json()["error"]["message"]


def test_a_function_call_and_its_output(served):
    base, client, pipe = served
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER], "temperature": 0, "max_output_tokens": 40,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    raw = post(base, body)
    _, ref = reference(pipe, [{"role": "user", "content": "What is the weather in Paris?"}], 40,
                       GuidedDecoding(json=WEATHER["parameters"]), tools=[chat_tool])
    [call] = raw["output"]
    assert (call["type"], call["name"], call["status"]) == ("function_call", "get_weather", "completed")
    assert call["arguments"] == pipe.decode(ref.token_ids) and json.loads(call["arguments"])["city"]
    assert call["call_id"].startswith("call_") and raw["tools"] == [WEATHER]
    check_stream(base, body, raw)
    # the result goes back as a function_call_output item; the conversation renders as chat's would
    answer = client.responses.create(model=MODEL, previous_response_id=raw["id"], max_output_tokens=24,
                                     temperature=0, tools=[WEATHER], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call["call_id"],
                                             "output": "Sunny, 21 C"}])
    convo = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": call["call_id"], "type": "function",
                  "function": {"name": "get_weather", "arguments": json.loads(call["arguments"])}}]},
             {"role": "tool", "tool_call_id": call["call_id"], "content": "Sunny, 21 C"}]
    _, ref = reference(pipe, convo, 24, tools=[chat_tool])
    assert answer.output_text == pipe.decode(ref.token_ids)


def test_a_json_schema_format(served):
    base, _, pipe = served
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"],
              "additionalProperties": False}
    body = {"input": ASK + " Answer in JSON.", "temperature": 0, "max_output_tokens": 40,
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}}
    raw = post(base, body)
    _, ref = reference(pipe, [{"role": "user", "content": ASK + " Answer in JSON."}], 40, GuidedDecoding(json=schema))
    text = raw["output"][0]["content"][0]["text"]
    assert text == pipe.decode(ref.token_ids) and set(json.loads(text)) == {"capital"}
    assert raw["text"] == body["text"]
    check_stream(base, body, raw)


def test_logprobs_are_chats(served):
    base, client, _ = served
    body = {"input": "Say hello.", "temperature": 0, "max_output_tokens": 6,
            "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    raw = post(base, body)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                          temperature=0, max_tokens=6, logprobs=True, top_logprobs=2)
    got = raw["output"][0]["content"][0]["logprobs"]
    assert got == chat.choices[0].logprobs.model_dump()["content"] and len(got) == raw["usage"]["output_tokens"]
    assert all(len(lp["top_logprobs"]) == 2 for lp in got)
    check_stream(base, body, raw)


def test_reasoning_items(smollm2_pipeline):
    """With --reasoning-parser deepseek-r1, an answer without </think> is all reasoning: one reasoning item."""
    pipe = smollm2_pipeline
    with live_server(pipe, max_batch_size=2, reasoning_parser="deepseek-r1") as (base, _):
        body = {"input": ASK, "temperature": 0, "max_output_tokens": 32}
        raw = post(base, body)
        _, ref = reference(pipe, [{"role": "user", "content": ASK}], 32)
        [item] = raw["output"]
        assert item["type"] == "reasoning" and item["summary"] == []
        assert item["content"] == [{"type": "reasoning_text", "text": pipe.decode(ref.token_ids)}]
        assert raw["usage"]["output_tokens_details"]["reasoning_tokens"] == raw["usage"]["output_tokens"] == len(ref.token_ids)
        got = check_stream(base, body, raw)
        assert "response.reasoning_text.delta" in {e["type"] for e in got}
        refused = httpx.post(base + "/v1/responses", json={**body, "top_logprobs": 2})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"


@pytest.mark.parametrize("body, status, param, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400,
     "input", "reads text only"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input", "item_reference"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input", "function_call_output"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input", "call_id"),
    ({"input": "Hi", "max_new_tokens": 8}, 400, "max_new_tokens", "use max_output_tokens"),
    ({"input": "Hi", "max_tokens": 8}, 400, "max_tokens", "did you mean max_output_tokens?"),
    ({"input": [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]}, 400, "input",
     "input[0] (function_call) needs 'call_id' as a non-empty string"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "", "arguments": "{}"}]}, 400, "input",
     "input[0] (function_call) needs 'name' as a non-empty string"),
    ({"input": "Hi", "tools": [{**WEATHER, "strict": "yes"}], "tool_choice": "required"}, 400, "tools",
     "has strict \"yes\""),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools", "built-in"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "tools": []}}, 400,
     "tool_choice", "allowed_tools"),
    ({"input": "Hi", "tools": [WEATHER]}, 400, "tool_choice", "--tool-parser"),
    ({"input": "Hi", "tools": [{**WEATHER, "parameters": {"type": "string"}}], "tool_choice": "required"}, 400,
     "tools", "object"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format", "schema"),
    ({"input": "Hi", "text": {"format": {"type": "regex"}}}, 400, "text.format", "json_object"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, 400,
     "text.format", ""),
    ({"input": "Hi", "max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens must be >= 1"),
    ({"input": "Hi", "max_output_tokens": 10 ** 6}, 400, "max_output_tokens", "ask for at most"),
    ({"input": "hello " * 9000}, 400, "input", "context"),
    ({"input": "Hi", "temperature": -1.0}, 400, "temperature", "temperature"),
    ({"input": "Hi", "background": True}, 400, "background", "not supported"),
    ({"input": "Hi", "truncation": "auto"}, 400, "truncation", "not supported"),
    ({"input": "Hi", "include": ["file_search_call.results"]}, 400, "include", "file_search_call.results"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": "required", "top_logprobs": 1}, 400, "top_logprobs",
     "plain text"),
    ({"input": "Hi", "temperatur": 0.5}, 400, "temperatur", "temperatur"),
    ({"input": "Hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id", "resp_nope"),
    ({"input": "Hi", "model": "gpt-5"}, 404, "model", "gpt-5"),
    ({}, 400, "input", "input"),
    ({"input": ""}, 400, "input", "no user message"),
    ({"input": []}, 400, "input", "no user message"),
    ({"input": [{"role": "developer", "content": "Be brief."}]}, 400, "input", "no user message"),
    ({"input": [{"role": "user", "content": []}]}, 400, "input", "no content parts"),
    ({"input": [{"role": "user", "content": ["\ud800"]}]}, 400, "input", '"\\ud800"'),
    ({"input": "Hi", "instructions": "\ud800"}, 400, "instructions", "surrogate"),
    ({"input": "Hi", "metadata": {"k": "\ud800"}}, 400, "metadata", "surrogate"),
    ({"input": "Hi", "metadata": {"\ud800": "v"}}, 400, "metadata", "surrogate"),
    ({"input": "Hi", "user": "\ud800"}, 400, "user", "surrogate"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "\ud800", "schema": {}}}}, 400, "text",
     "surrogate"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather", "x": "\ud800"}},
     400, "tool_choice", "surrogate"),
    ({"input": "Hi", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata", "16 pairs"),
    ({"input": "Hi", "metadata": {"k": "v" * 513}}, 400, "metadata", "512"),
    ({"input": "Hi", "user": "u" * 513}, 400, "user", "512"),
    ({"input": "Hi", "reasoning": "high"}, 400, "reasoning", "reasoning"),
    ({"input": "Hi", "reasoning": {"effort": "ultra"}}, 400, "reasoning", "effort"),
    ({"input": "Hi", "text": {"verbosity": "extreme"}}, 400, "text", "verbosity"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, 400, "text.format",
     '"name"'),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "yes"}}}, 400,
     "text.format", '"strict"'),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
      "text": {"format": {"type": "json_object"}}}, 400, "tool_choice", "text.format"),
    ({"input": "Hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "chat's form"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather", "x": 1}}, 400,
     "tool_choice", "tool_choice must be"),
    ({"input": "Hi", "previous_response_id": ""}, 400, "previous_response_id", "empty"),
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     400, "input", "no function call found"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c1", "name": "g", "arguments": "{}"}]}, 400, "input", "c1"),
    ({"input": "Hi", "tools": [{**WEATHER, "parameters": {"type": "object", "x": NESTED}}], "tool_choice": "required"},
     400, "tools", "nests"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object",
                                                                                     "x": NESTED}}}},
     400, "text", "nests"),
    ([1, 2], 400, None, '{"input": "Hi"}'),
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "reasoning", "summary": [],
                                                     "content": [{"type": "reasoning_text", "text": "\ud800"}]}]},
     400, "input", "surrogate"),
    ({"input": [{"role": "user", "content": "Hi", "id": "msg\ud800"}]}, 400, "input", "surrogate"),
    ({"input": [{"role": "user", "content": "a", "id": "m1"}, {"role": "user", "content": "b", "id": "m1"}]}, 400,
     "input", "earlier item"),
    ({"input": [{"role": "user", "content": "Hi", "id": 5}]}, 400, "input", "not a string"),
    ({"input": [{"role": "user", "content": "Hi", "status": "bogus"}]}, 400, "input", "status"),
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "reasoning", "summary": "x"}]}, 400, "input", "summary"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "x": NESTED}]}, 400,
     "input", "nests"),
    ({"input": "Hi", "chat_template_kwargs": {"x": NESTED}}, 400, "chat_template_kwargs", "nests"),
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]}, 400, "input",
     "no function_call_output found"),
    ({"input": "Hi", "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice", '"name": "nope"'),
    ({"input": "Hi", "tools": [{"type": "function", "name": "messages", "parameters": {"type": "string"}}],
      "tool_choice": "required"}, 400, "tools", "'messages'"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "paramters": {"type": "object"}}]}, 400, "tools",
     "tools[0] has the field 'paramters', which a function tool does not take (it takes type, name, description, "
     "parameters, strict); did you mean 'parameters'?"),
])
def test_bad_requests_name_the_field(served, body, status, param, words):
    base, _, _ = served
    r = httpx.post(base + "/v1/responses", content=json.dumps(body), timeout=120,  # JSON escapes: lone surrogates
                   headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert post(base, {"input": "Hi", "max_output_tokens": 2})["usage"]["output_tokens"] == 2  # still serving


def test_input_items_become_chat_messages():
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "two"}]}]
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("parser, text, finish, kinds", [
    ("deepseek-r1", ('need the time</think>\n\nOne moment. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
                     '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'), "stop",
     ["reasoning", "message", "function_call", "function_call"]),
    ("deepseek-r1", "all reasoning, cut", "length", ["reasoning"]),
    ("deepseek-r1", "</think>", "stop", ["message"]),
    ("deepseek-r1", "short</think>The answer is <tool_c", "length", ["reasoning", "message"]),
    ("deepseek-r1", "cut by a shutdown</think>Hel", "abort", ["reasoning", "message"]),
    ("qwen3", "<think>why</think>Because.", "stop", ["reasoning", "message"]),
    # text before <think>: its own message item, before the reasoning (streamed, it went out before the reasoning)
    ("qwen3", "Hi <think>let me see</think> there > <think>not reasoning</think>", "stop",
     ["message", "reasoning", "message"]),
    ("qwen3", 'Sure. <think>a</think><tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "stop",
     ["message", "reasoning", "function_call"]),
    ("qwen3", "Hi<think>cut", "length", ["message", "reasoning"]),
    # a call that went wrong (a stop string cut it, its JSON broke off): its item is "incomplete", as chat's
    # finish_reason is not "tool_calls"
    ("deepseek-r1", 'why</think><tool_call>{"name": "get_time", "arguments": {"tz": "UT', "stop",
     ["reasoning", "function_call"]),
    ("deepseek-r1", ('</think>Two. <tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": '
                     '"get_time", "arguments": {"tz": 1 2}}</tool_call>'), "stop", ["message", "function_call", "function_call"]),
])
def test_events_join_to_the_whole_output(parser, text, finish, kinds):
    """Any split of an answer into stream deltas gives the items (and final Response) the whole answer gives, in the
    order the answer writes them; their texts are the chat message's. The last item is "incomplete" when the answer
    was cut or its last call went wrong (chat's finish_reason is then not "tool_calls"), the others "completed"; the
    Response is "completed" only when every item is."""
    from openai.types.responses import Response

    tools = ({"name": "get_time", "description": None, "parameters": {"type": "object", "properties": {}}},)
    answers = ChatAnswers(ToolCalling(tools, "auto", None, "hermes"), parser, guided=None)
    req = ResponsesRequest(input="x")
    start = response_object("resp_1", 0, MODEL, req, [], "in_progress", None)
    whole = whole_response(start, answers.stream(), text, finish, None)
    assert [it["type"] for it in whole["output"]] == kinds
    message, chat_finish = answers.message(text, finish)
    broken = bool(message.get("tool_calls")) and chat_finish != "tool_calls"
    assert [it["status"] for it in whole["output"]] == ["completed"] * (len(kinds) - 1) + [
        "completed" if finish == "stop" and not broken else "incomplete"]
    assert "".join(p["text"] for it in whole["output"] if it["type"] == "message" for p in it["content"]) == (
        message["content"] or "")
    assert "".join(p["text"] for it in whole["output"] if it["type"] == "reasoning" for p in it["content"]) == (
        message["reasoning_content"] or "")
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        state, out = answers.stream(), ResponseEvents(start)
        got = out.start() + out.delta(state.opening() or {})
        for p in parts[:-1]:
            got += out.text(state, p)
        got += out.end(state, parts[-1], finish, None)
        assert [e["sequence_number"] for e in got] == list(range(len(got)))
        final = got[-1]["response"]
        assert strip(final["output"]) == strip(whole["output"])
        status = {"length": "incomplete", "abort": "failed"}.get(finish, "incomplete" if broken else "completed")
        assert final["status"] == whole["status"] == status and got[-1]["type"] == "response." + status
        # a Response is "completed" only when all its items are; a broken call's has no reason among OpenAI's
        assert final["incomplete_details"] == ({"reason": "max_output_tokens"} if finish == "length" else
                                               {"reason": None} if status == "incomplete" else None)
        Response.model_validate(final)  # OpenAI's own type accepts it
        assert (final["error"] is None) == (finish != "abort")
        assert final["output"][-1]["status"] == ("completed" if finish == "stop" and not broken else "incomplete")


@pytest.mark.parametrize("fields, param, code, words", [
    ({"truncation": "sometimes"}, "truncation", "invalid_value", "'auto' or 'disabled'"),
    ({"truncation": 1}, "truncation", "invalid_type", "'auto' or 'disabled'"),
    ({"service_tier": "fastest"}, "service_tier", "invalid_value", "'priority'"),
    ({"tool_choice": "always"}, "tool_choice", "invalid_value", "Invalid value: 'always'"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "invalid_value", "'none', 'auto' and 'required'"),
    ({"include": ["output_text.logprobs"]}, "include", "invalid_value", "Invalid value: 'output_text.logprobs'"),
    ({"service_tier": 1}, "service_tier", "invalid_type", "service_tier"),
    ({"prompt_cache_key": 7}, "prompt_cache_key", "invalid_type", "valid string"),
    ({"safety_identifier": ["u1"]}, "safety_identifier", "invalid_type", "valid string"),
    ({"background": "no"}, "background", "invalid_type", "valid boolean"),
    ({"max_tool_calls": "2"}, "max_tool_calls", "invalid_type", "valid integer"),
    ({"conversation": 5}, "conversation", "invalid_type", "conversation"),
    ({"temperature": "hot"}, "temperature", "invalid_type", "valid number"),
    ({"stream": True, "stream_options": {"include_usage": True}}, "stream_options", "unknown_parameter",
     "include_usage"),
    ({"stream": True, "stream_options": "yes"}, "stream_options", "invalid_type", "stream_options"),
    ({"max_output_token": 5}, "max_output_token", "unknown_parameter", "did you mean max_output_tokens?"),
    # OpenAI's values, which this server does not serve: refused naming the field, without an OpenAI code
    ({"truncation": "auto"}, "truncation", None, "not supported by this server"),
    ({"include": ["file_search_call.results"]}, "include", None, "does not return"),
])
def test_fields_openai_refuses_are_refused_as_openai_does(served, fields, param, code, words):
    """Request fields OpenAI's Responses endpoint refuses (a value of the wrong type, outside the field's enum,
    an unknown field), through the real openai client: a 400 with OpenAI's error type, param and code
    (invalid_type, invalid_value, unknown_parameter); they were taken silently (service_tier, prompt_cache_key,
    safety_identifier, stream_options) or refused as "not supported" when they were merely wrong (truncation,
    background, max_tool_calls, conversation), and tool_choice "always" was told it needs tools. The server
    keeps serving."""
    import openai

    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, extra_body=fields)
    e = caught.value
    assert (e.status_code, e.type, e.param, e.code) == (400, "invalid_request_error", param, code), e.body
    assert words in e.message
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).usage.output_tokens == 2
    ok = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, service_tier="flex", truncation="disabled",
                                 prompt_cache_key="k", safety_identifier="u", background=False)
    assert (ok.service_tier, ok.truncation, ok.prompt_cache_key, ok.safety_identifier) == ("flex", "disabled", "k", "u")
