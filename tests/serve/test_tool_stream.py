"""Tool calls read from a growing answer (`dflash_trt.serve.tool_stream`): the whole answer's content and calls,
and streamed deltas that join to exactly that message for every way the text is cut (every cut point, every
character alone, random cuts with a fixed seed, and the real model's token deltas), malformed answers too, with
each call's id in its first delta only and nothing sent that the end takes back."""

from __future__ import annotations

import json
import random

import pytest

from dflash_trt.runtime.guided import GuidedDecoding
from dflash_trt.serve.chat import ChatAnswers
from dflash_trt.serve.tool_stream import parse_hermes, parse_llama3_json, read_answer
from dflash_trt.serve.tools import ToolCalling, required_schema
from tests.serve.test_tools_http import ASK, HERMES, TIME, WEATHER, reference

TOOLS = tuple({**t["function"], "description": t["function"].get("description")} for t in (WEATHER, TIME))


@pytest.mark.parametrize("text, content, calls", [
    ("plain text", "plain text", []),
    ("", "", []),
    ('Sure.\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "Sure.", [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "g", "arguments": {"x": "é"}}', None,
     [("f", "{}"), ("g", '{"x": "é"}')]),
    ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', None, [("f", '{"a": 1}')]),  # Llama 3's key
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", '{"a": 1}')]),  # JSON text
    ('<tool_call>{"arguments": {"a":1}, "name": "f", "id": 3}</tool_call>', None, [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}\n</tool_c', None, [("f", '{"a": 1}')]),  # cut in the tag
    ('<tool_call>{"name": "f", "arguments": null}</tool_call>', None, [("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {"s": "a</tool_call>b"}}</tool_call>', None,
     [("f", '{"s": "a</tool_call>b"}')]),
    # a call whose JSON is whole is one, whatever comes before the next <tool_call> (a missing </tool_call>)
    ('<tool_call>{"name": "f"} junk</tool_call>', None, [("f", "{}")]),
    ('<tool_call>{"name": "f"}\n<tool_call>{"name": "g"}</tool_call> after', None, [("f", "{}"), ("g", "{}")]),
    # not a call before its name is whole: the first makes the answer content, a later one ends the calls
    ('<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),
    ("I use <tool_call> tags", "I use <tool_call> tags", []),
    # a "<" that begins no tag, or a tag's beginning cut, right before one (the tag is looked for from the last "<")
    ('1 < 2 <<tool_<tool_call>{"name": "f"}</tool_call>', "1 < 2 <<tool_", [("f", "{}")]),
    ("a <tool_cal", "a <tool_cal", []),
    ('x <tool_call>{"nam": "f"}</tool_call> <tool_call>{"name": "g"}</tool_call>',
     'x <tool_call>{"nam": "f"}</tool_call> <tool_call>{"name": "g"}</tool_call>', []),
    ('A <tool_call>{"name": "f"}</tool_call>\n<tool_call>{"na', "A", [("f", "{}")]),
    ('<tool_call>{"name": "f"}</tool_call><tool_call>[1]</tool_call><tool_call>{"name": "g"}</tool_call>', None,
     [("f", "{}")]),
    # a call that goes wrong after its name keeps its arguments as far as they were sure: not JSON (no closing
    # brace), as a call cut by max_tokens
    ('x <tool_call>{"name": "f", "arguments": {"a": </tool_call>', "x", [("f", '{"a": ')]),
    ('<tool_call>{"name": "f", "arguments": "a=1"}</tool_call>', None, [("f", "")]),
    ('<tool_call>{"name": "f", "arguments": {"s": "a</tool_call>', None, [("f", '{"s": "a</tool_call>')]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}, "parameters": {}}</tool_call>', None, [("f", '{"a": 1')]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>', None, [("f", '{"a": 1, "a"')]),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', None, [("f", '{"x": ')]),
    ('<tool_call>{"name": "f", "arguments": {"x": \u0663}}</tool_call>', None, [("f", '{"x": ')]),  # an Arabic 3
    # a lone surrogate stays an escape (UTF-8, so the response, cannot carry the character)
    ('<tool_call>{"name": "f", "arguments": {"s": "\\ud800"}}</tool_call>', None, [("f", '{"s": "\\ud800"}')]),
    ('<tool_call>{"name": "f", "arguments": "{\\"s\\": \\"\\ud800\\"}"}</tool_call>', None,
     [("f", '{"s": "\\ud800"}')]),
    ('<tool_call>{"name": "\\ud800"}</tool_call>', '<tool_call>{"name": "\\ud800"}</tool_call>', []),  # no name
    ('<tool_call>{"name": "f"}</tool_call><tool_call>{"arguments": {}, "name": "g\\udfff"}</tool_call>', None,
     [("f", "{}")]),
    ('A <tool_call>{"name": "f", "arguments": {"n": ' + "1" * 4301 + '}}</tool_call>', "A", [("f", '{"n": ')]),
    ('<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "g", "arguments": ' + "[" * 100_000, None,
     [("f", "{}"), ("g", "")]),
    *[('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {"s": '
       '"</tool_call>", "b": ' + cut, None, [("f", "{}"), ("g", '{"s": "</tool_call>", "b": ' + sure)])
      for cut, sure in (("tru", ""), ("nul", ""), ("-", ""), ("1.", ""), ("1e+", ""), ("12", "12"), ('"\\u12', '"'))],
], ids=lambda v: v[:60] if isinstance(v, str) else None)
def test_parse_hermes(text, content, calls):
    assert parse_hermes(text) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "f", "parameters": {"a": 1}}', None, [("f", '{"a": 1}')]),
    (' <|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"b": "x"}}\n', None,
     [("f", "{}"), ("g", '{"b": "x"}')]),
    ('{"name": "f", "parameters": {}}; {"name": "g", "parameters"', None, [("f", "{}"), ("g", "")]),
    # a call only with an arguments key right after its name (whole): JSON about a person is not a call to "Alice"
    ('{"name": "f", "parameters": {}}; {"name": "g", "param', None, [("f", "{}")]),
    ('{"name": "Alice", "age": 30}', '{"name": "Alice", "age": 30}', []),
    ('{"name": "Alice", "age": 30, "arguments": {}}', '{"name": "Alice", "age": 30, "arguments": {}}', []),
    ('{"name": "f"}', '{"name": "f"}', []),
    ('{"name": "f", "parameters": {}}; {"name": "g"}', None, [("f", "{}")]),
    ('{"name": "f", "parameters": {}}; {"name": "g", "id": 1, "parameters": {}}', None, [("f", "{}")]),
    ('{"parameters": {"a": 1}, "name": "f"}', None, [("f", '{"a": 1}')]),  # name not first: whole, with arguments
    ('{"age": 30, "name": "Alice"}', '{"age": 30, "name": "Alice"}', []),
    ('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": fals', None, [("f", "{}"), ("g", '{"b": ')]),
    ('{"name": "f", "parameters": {"a": 1}} and then text', None, [("f", '{"a": 1}')]),  # the rest dropped
    ('The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but not a call
    ("  <|python", "  <|python", []),
    ('{"nam', '{"nam', []),
])
def test_parse_llama3_json(text, content, calls):
    assert parse_llama3_json(text) == (content, calls)


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("llama3_json", '{"name": "get_time", "parameters": {}}', None, [("get_time", "{}")]),
    # llama3_json: a "name" that is no tool's is data, not a call
    ("llama3_json", '{"name": "Alice", "parameters": {"age": 30}}', '{"name": "Alice", "parameters": {"age": 30}}', []),
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "Alice", "parameters": {}}', None,
     [("get_time", "{}")]),
    ("llama3_json", '{"parameters": {}, "name": "Alice"}', '{"parameters": {}, "name": "Alice"}', []),
    # hermes ("required" too) takes any name: its tags (the grammar) mark calls
    ("hermes", '<tool_call>{"name": "Alice"}</tool_call>', None, [("Alice", "{}")]),
    ("required", '[{"name": "Alice", "parameters": {}}]', None, [("Alice", "{}")]),
])
def test_llama3_json_calls_only_the_tools(fmt, text, content, calls):
    assert read_answer(fmt, text, names=["get_time", "get_weather"]) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('[{"name": "f", "parameters": {}}, {"name": "g", "param', None, [("f", "{}"), ("g", "")]),
    ('  [ {"name": "f", "parameters": {"a": [1]}} \n\n ', None, [("f", '{"a": [1]}')]),
    ('[{"name": "f", "parameters": {}} {"name"', None, [("f", "{}")]),
    ('[{"name": "f", "parameters": {"a": "b', None, [("f", '{"a": "b')]),
    ('[{"name": "f", "par', None, [("f", "")]),
    ('[{"na', '[{"na', []),
    ("", "", []),
    ("{}", "{}", []),
])
def test_required_calls(text, content, calls):
    assert read_answer("required", text) == (content, calls)


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '<tool_call>{"name": "get_time"}</tool_call><tool_call>{"name": "get_weather"}</tool_call>'
    assert ToolCalling(TOOLS, "auto", None, "hermes", parallel=False).calls(text) == (None, [("get_time", "{}")])
    assert len(ToolCalling(TOOLS, "auto", None, "hermes").calls(text)[1]) == 2


def stream(calling: ToolCalling, parts: list[str], finish: str) -> tuple[list[dict], str]:
    """The deltas that are sent (the opening one first, when it does not wait) and finish_reason of a chat choice
    whose text comes in `parts` (`ChatStream`)."""
    s = ChatAnswers(calling, None, None).stream()
    deltas = [s.opening()] + [s.delta(p) for p in parts[:-1]]
    last, got = s.last(parts[-1], finish)
    return [d for d in deltas + [last] if d], got


def sdk_content(deltas: list[dict]):
    """The content the openai SDK's stream accumulation makes of `deltas`: the first value given (null too), then
    each string added to a string."""
    content = None
    for d in deltas:
        if "content" in d and isinstance(d["content"], str):
            content = d["content"] if content is None else content + d["content"]
    return content


def check_joined(calling: ToolCalling, text: str, parts: list[str], finish: str) -> None:
    """The deltas of `parts` join to the message of `text`: the role in the first delta only, its content (null
    where the message's is: OpenAI streams `content: null` for an answer that is calls), its calls (their name and
    arguments, each call's id, type and name in its first delta only, the arguments in order), its finish_reason."""
    message, want_finish = calling.message(text, finish)
    deltas, got_finish = stream(calling, parts, finish)
    assert got_finish == want_finish
    assert deltas and deltas[0]["role"] == "assistant" and not any("role" in d for d in deltas[1:])
    assert sdk_content(deltas) == message["content"]
    if message["content"] is None:  # an answer that is calls: content null from the first delta, as OpenAI's
        assert deltas[0]["content"] is None and not any("content" in d for d in deltas[1:])
    calls: dict[int, dict] = {}
    for d in deltas:
        for t in d.get("tool_calls", []):
            if t["index"] not in calls:  # the first delta of a call: its id, type and name
                assert set(t) == {"index", "id", "type", "function"} and t["type"] == "function", t
                calls[t["index"]] = {"id": t["id"], "name": t["function"]["name"], "arguments": ""}
            else:  # the next: more arguments, never another id or name
                assert set(t) == {"index", "function"} and set(t["function"]) == {"arguments"}, t
                assert t["function"]["arguments"]
            calls[t["index"]]["arguments"] += t["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (t["function"]["name"], t["function"]["arguments"]) for t in message.get("tool_calls", [])]
    assert len({c["id"] for c in calls.values()}) == len(calls) and all(c["id"].startswith("call_")
                                                                         for c in calls.values())


def every_split(text: str, seed: int = 0, tries: int = 30):
    """`text` whole, cut at each point, one character at a time, and cut at random points (a fixed seed)."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text) or [""]
    rng = random.Random(seed)
    for _ in range(tries if len(text) > 1 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(10, len(text) - 1))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


#: (choice: "auto" reads the parser's format, text, finish_reason); the stream must join to the message for each
CASES = [
    ("hermes", 'I will look it up <tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>',
     "stop"),
    ("hermes", "The <tool weather is < nice <tool_cal", "length"),
    ("hermes", '1 < 2 <<tool_<tool_call>{"name": "get_time"}</tool_call>', "stop"),  # "<"s right before the tag
    ("hermes", 'Two calls:<tool_call>{"name": "get_time"}</tool_call>\n<tool_call>{"name": "get_weather", '
               '"arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>', "stop"),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "S\\"ão \\u00e9 \\ud83d\\ude00 P\\\\aulo", '
               '"unit": "celsius", "n": [1.50, -2E3, true, null]}}</tool_call>', "stop"),
    ("hermes", 'Text <tool_call>{"name": "get_weather", "arguments": {"city": "Par', "length"),  # cut mid-string
    ("hermes", 'Text <tool_call>{"name": "get_wea', "length"),  # cut mid-name: text
    ("hermes", 'Hm <tool_call>{"name": 12}</tool_call> then text <tool_call>{"name": "x"}</tool_call>', "stop"),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": 1 2}}</tool_call>', "stop"),  # broken after name
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"a": "\\udc00", "tz": \u0663}}</tool_call>', "stop"),
    ("hermes", 'A <tool_call>{"name": "get_\\ud83d", "arguments": {}}</tool_call>', "stop"),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', "stop"),
    ("hermes", '<tool_call>{"arguments": {}, "name": "get_time"}</tool_call><tool_call>{"name": "g", "a', "length"),
    ("hermes", '   \n', "stop"),
    ("required", '[{"name": "get_time", "parameters": {"timezone": "UTC"}}]', "stop"),
    ("required", '[{"name": "get_time", "param', "length"),
    ("required", '[{"name": "get_time", "parameters": {"timezone": "UTC"}}, {"name": "get_weather", "para', "length"),
    ("required", '[\n  {"name": "get_weather", "parameters": {"city": "Lyon", "unit": "celsius"}},\n  '
                 '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}\n]', "stop"),
    ("function", '{"city": "Paris", "unit": "celsius"}', "stop"),
    ("none", "a <tool_call> is only text here", "stop"),
    ("llama3_json", '  {"name": "get_time", "parameters": {"timezone": "UTC"}}; {"name": "get_weather", '
                    '"parameters": {"city": "Paris"}}', "stop"),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}', "stop"),
    ("llama3_json", "  Paris is {sunny} today.", "stop"),
    ("llama3_json", '{"name": "get_time", "parameters": {"timezone": "U', "length"),
    ("llama3_json", '{"timezone": "UTC"}', "stop"),
]


def calling_for(choice: str) -> ToolCalling:
    if choice in ("hermes", "llama3_json"):
        return ToolCalling(TOOLS, "auto", None, choice)
    return ToolCalling(TOOLS, choice, "get_weather" if choice == "function" else None, "hermes")


@pytest.mark.parametrize("choice, text, finish", CASES, ids=lambda v: v[:50] if isinstance(v, str) else None)
def test_streamed_deltas_join_to_the_message_however_cut(choice, text, finish):
    calling = calling_for(choice)
    for parts in every_split(text):
        check_joined(calling, text, parts, finish)


@pytest.mark.parametrize("choice, text, finish", [c for c in CASES if c[0] not in ("none", "function")],
                         ids=lambda v: v[:50] if isinstance(v, str) else None)
def test_damaged_answers_stream_to_their_message(choice, text, finish):
    """The cases with characters dropped, added (JSON's and the tags') or the text cut, at random (a fixed seed):
    whatever the answer turns out to be, what was streamed is part of it."""
    rng, calling = random.Random(text), calling_for(choice)
    for k in range(25):
        chars = list(text)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(chars) + 1)
            op = rng.random()
            if op < 0.4 and chars:
                del chars[min(i, len(chars) - 1)]
            elif op < 0.8:
                chars.insert(i, rng.choice('{}[]":,\\ u<>/a1e.-n_\n'))
            else:
                del chars[i:]
        damaged = "".join(chars)
        for parts in every_split(damaged, seed=k, tries=8) if damaged else ():
            for end in ("stop", "length"):
                check_joined(calling, damaged, parts, end)


def test_calls_stream_as_they_are_written():
    """A call's id and name go out once the name is whole, its arguments as they come; text that may still be
    something else (a partial tag, the name, the closing brace) waits."""
    calling = ToolCalling(TOOLS, "auto", None, "hermes")
    s = calling.stream()
    got = [s.delta(p) for p in ("Let me check. <tool", '_call>\n{"name": "get_', 'weather", "arguments": {"ci',
                                'ty": "Par', 'is"}', "}\n</tool_call>")]
    assert got[0] == {"content": "Let me check."} and got[1] == {}
    [head] = got[2]["tool_calls"]
    assert head == {"index": 0, "id": head["id"], "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"ci'}}
    assert [d["tool_calls"][0]["function"]["arguments"] for d in got[3:]] == ['ty": "Par', 'is"', "}"]
    assert s.last("", "stop") == ({}, "tool_calls")


def test_a_llama3_json_call_waits_for_its_arguments_key():
    """llama3_json: a call goes out once the key after its name is whole and is an arguments key; another key makes
    the answer content, sent from there."""
    s = calling_for("llama3_json").stream()
    got = [s.delta(p) for p in ('{"name": "get_time"', ', "param', 'eters": {"timez', 'one": "UTC"}}')]
    assert got[:2] == [{}, {}]
    [head] = got[2]["tool_calls"]
    assert head["function"] == {"name": "get_time", "arguments": '{"timez'}
    assert got[3]["tool_calls"][0]["function"] == {"arguments": 'one": "UTC"}'}
    assert s.last("", "stop") == ({}, "tool_calls")
    s = calling_for("llama3_json").stream()
    assert [s.delta(p) for p in ('{"name": "get_time"', ', "age": 30', "}")] == [
        {}, {"content": '{"name": "get_time", "age": 30'}, {"content": "}"}]
    assert s.last("", "stop") == ({}, "stop")


#: (choice, text, the engine's finish_reason, the choice's): "tool_calls" only when every call returned is whole
FINISHES = [
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}</tool_call>', "stop", "tool_calls"),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}</tool_call>', "length", "length"),
    # a stop string cut the call, or its JSON broke off: not usable, so not "tool_calls"
    ("hermes", 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", ', "stop", "stop"),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": 1 2}}</tool_call>', "stop", "stop"),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", '
               '"arguments": {"city": ', "stop", "stop"),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "tz=UTC"}</tool_call>', "stop", "stop"),
    # an object that is no call ends the calls: those returned are whole
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call><tool_call>{"na', "stop", "tool_calls"),
    ("hermes", "no call", "stop", "stop"),
    ("required", '[{"name": "get_time", "parameters": {"timezone": "UTC"}}, {"name": "get_weather", "para', "stop",
     "stop"),
    ("required", '[{"name": "get_time", "parameters": {"timezone": "UTC"}}, {"na', "stop", "tool_calls"),
    ("llama3_json", '{"name": "get_time", "parameters": {"timezone": "U', "stop", "stop"),
    ("llama3_json", '{"name": "get_time", "parameters"', "stop", "stop"),
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "par', "stop", "tool_calls"),
    ("llama3_json", '{"name": "get_time"', "stop", "stop"),
    ("function", '{"city": "Par', "stop", "stop"),
]


@pytest.mark.parametrize("choice, text, finish, want", FINISHES, ids=lambda v: v[:50] if isinstance(v, str) else None)
def test_finish_reason_is_tool_calls_only_when_every_call_is_whole(choice, text, finish, want):
    """Non-streamed and streamed (every split: the last chunk carries it), the finish_reason is "tool_calls" only
    when the answer stopped with calls and each is whole; a broken last call leaves the engine's."""
    calling = calling_for(choice)
    message, got = calling.message(text, finish)
    assert got == want
    calls = message.get("tool_calls", [])
    if choice != "function":  # whole: the arguments are valid JSON
        assert (got == "tool_calls") == (finish == "stop" and bool(calls) and all(
            _is_json(t["function"]["arguments"]) for t in calls))
    for parts in every_split(text, tries=10):
        check_joined(calling, text, parts, finish)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("choice, regex_or_schema, tools", [
    ("hermes", HERMES, [WEATHER]),
    ("required", None, [WEATHER, TIME]),
    ("llama3_json", '\\{"name": "get_weather", "parameters": \\{"city": "(Paris|Lyon)", "unit": "celsius"\\}\\}',
     [WEATHER]),
])
def test_real_answers_stream_to_their_message(smollm2_pipeline, choice, regex_or_schema, tools):
    """SmolLM2's answers (guided into each format): cut at every point and at its tokens' boundaries, and cut by
    max_tokens after each token, the deltas join to the message."""
    pipe = smollm2_pipeline
    spec = (GuidedDecoding(regex=regex_or_schema) if regex_or_schema is not None
            else GuidedDecoding(json=required_schema(tuple(t["function"] for t in tools))))
    ref = reference(pipe, ASK, tools, spec, 96)
    assert ref.finish_reason == "stop", ref
    calling = calling_for(choice)
    message, finish = calling.message(ref.text, "stop")
    assert message["tool_calls"] and finish == "tool_calls"
    ends = [len(pipe.decode(ref.token_ids[:n])) for n in range(1, len(ref.token_ids) + 1)]
    tokens = [ref.text[a:b] for a, b in zip([0, *ends], ends)]
    assert "".join(tokens) == ref.text
    for parts in [tokens, *every_split(ref.text)]:
        check_joined(calling, ref.text, parts, "stop")
    for n in range(1, len(tokens)):  # cut by max_tokens after n tokens
        check_joined(calling, "".join(tokens[:n]), tokens[:n], "length")


@pytest.mark.parametrize("text", [
    "a" + " \n" * 40_000,  # a content that ends in whitespace (held back while a call may follow)
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 1_500,  # many calls
], ids=["trailing whitespace", "many calls"])
def test_each_delta_reads_only_what_is_new(text):
    """An answer streamed a character at a time takes time linear in its length: a delta does not look again at
    the run of whitespace before it, nor at the calls already sent whole (each was once quadratic: minutes here)."""
    import time

    calling = ToolCalling(TOOLS, "auto", None, "hermes")
    start = time.perf_counter()
    check_joined(calling, text, list(text), "stop")
    assert time.perf_counter() - start < 20
