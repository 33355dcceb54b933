"""Streamed tool calls do work linear in the answer's length (`dflash_trt.serve.tool_stream`): a long argument
string, a long number in the arguments, a long run of whitespace before a call, fed a character at a time, copy a
few characters per character, not the whole run again at each delta (`dflash_trt.text.GrowingText`, whose slices
the readers take, counts what they copy)."""

from __future__ import annotations

import random

import pytest

from dflash_trt.serve.tools import ToolCalling
from dflash_trt.text import GrowingText
from tests.serve.test_tool_stream import check_joined

TOOLS = ({"name": "f", "description": None, "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}},)


def test_growing_text_slices_as_a_str():
    """Every slice of a text grown by random pieces (empty ones too) is the `str`'s; `str()` joins them."""
    rng = random.Random(0)
    text, want = GrowingText(), ""
    for _ in range(300):
        piece = "".join(rng.choice("ab\u00e9\U0001f600") for _ in range(rng.choice((0, 1, 1, 3, 17))))
        text.append(piece)
        want += piece
        assert len(text) == len(want)
        for _ in range(5):
            a = rng.randrange(len(want) + 2)
            b = rng.choice((None, rng.randrange(len(want) + 3)))
            assert text.slice(a, b) == want[a:b], (a, b)
    assert str(text) == want and text.slice(0) == want
    text.append("z")  # still grows after being joined
    assert str(text) == want + "z" and text.slice(len(want)) == "z" and str(GrowingText()) == ""


#: (tool_choice: "required" reads its JSON array, else the --tool-parser's format under "auto"; the answer before
#: the argument's characters; after them)
FORMATS = [
    ("required", '[{"name": "f", "parameters": {"a": "', '"}}]'),
    ("hermes", "Let me see. " * 100 + '<tool_call>\n{"name": "f", "arguments": {"a": "', '"}}\n</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": "', '"}}'),
]


@pytest.mark.parametrize("fmt, head, tail", FORMATS, ids=[f[0] for f in FORMATS])
def test_a_long_argument_streams_in_linear_work(fmt, head, tail):
    """A call whose argument is a string of 10k, then 100k characters, streamed a character per delta: the
    deltas join to the message, and the characters copied out of the readers' texts (`GrowingText.copied`) are a
    few per character of the answer, so 10 times the answer copies about 10 times as much (it was ~n²/2: each delta
    sliced the whole argument again, twice).

    Why a count and not a clock: the quadratic part was memory copying, which is fast, so on this machine the old
    code took only ~21x the time for 10x the input (2.4 s for a 200k-character argument) -- below the ~30x bound a
    busy shared 2-core machine needs to keep a timing test from failing at random. The count is exact, the same on
    any machine, and grows 100x for 10x the input if a delta reads the whole argument again."""
    calling = ToolCalling(TOOLS, "required" if fmt == "required" else "auto", None, "hermes" if fmt == "required"
                          else fmt)
    copied = []
    for n in (10_000, 100_000):
        text = head + "x" * n + tail
        GrowingText.copied = 0
        check_joined(calling, text, list(text), "stop")  # (the whole answer's message read once, too)
        copied.append(GrowingText.copied)
        assert GrowingText.copied <= 16 * len(text), (n, GrowingText.copied)
    assert copied[1] <= 10.5 * copied[0], copied
    message, finish = calling.message(text, "stop")
    assert finish == "tool_calls"
    assert message["tool_calls"][0]["function"]["arguments"] == '{"a": "' + "x" * 100_000 + '"}'


#: (tool_choice "required" or the --tool-parser's format under "auto"; the answer, "{n}" where the long run goes;
#: what the run is made of; the first call's arguments): a long number in the arguments, which is not whole (so not
#: written) until a character after it comes (it was read again from its first digit at every delta), and a long
#: run of whitespace before or between the calls, in the formats without a tag (matched again from the last call at
#: every delta)
RUNS = [
    ("required", '[{"name": "f", "parameters": {"a": 0.{n}}}]', "1", '{"a": 0.1111111111111111}'),
    # too many digits for Python's int (over 4300): the call breaks there, its arguments as far as they were sure
    ("required", '[{"name": "f", "parameters": {"a": 1{n}}}]', "0", '{"a": '),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 0.{n}, "b": 2}}</tool_call>', "5",
     '{"a": 0.5555555555555556, "b": 2}'),
    ("llama3_json", '{"name": "f", "parameters": {"a": -1.{n}e-3}}', "7", '{"a": -0.0017777777777777779}'),
    ("required", '{n}[{"name": "f", "parameters": {}}]', " \n", "{}"),
    ("required", '[{n}{"name": "f", "parameters": {}}]', " ", "{}"),
    ("required", '[{"name": "f", "parameters": {}}{n}, {n}{"name": "f", "parameters": {}}{n}]', "\t", "{}"),
    ("llama3_json", '{n}{"name": "f", "parameters": {}}', "\n", "{}"),
    ("llama3_json", '<|python_tag|>{n}{"name": "f", "parameters": {}}', " ", "{}"),
    ("llama3_json", '{"name": "f", "parameters": {}};{n}{"name": "f", "parameters": {}}', " ;", "{}"),
]


@pytest.mark.parametrize("fmt, answer, run, arguments", RUNS, ids=[f"{f}-{a[:24]}" for f, a, _, _ in RUNS])
def test_a_long_number_or_whitespace_streams_in_linear_work(fmt, answer, run, arguments):
    """A call with a number of 5k, then 50k digits in its arguments, or 5k, then 50k characters of whitespace before
    or between calls, streamed a character per delta: the deltas join to the message and the characters copied out
    of the readers' texts (`GrowingText.copied`) are a few per character of the answer (it was ~n²/2: each delta
    sliced the whole number, or the whole run of whitespace, again)."""
    calling = ToolCalling(TOOLS, "required" if fmt == "required" else "auto", None, "hermes" if fmt == "required"
                          else fmt)
    copied = []
    for n in (5_000, 50_000):
        text = answer.replace("{n}", run * (n // len(run)))
        GrowingText.copied = 0
        check_joined(calling, text, list(text), "stop")
        copied.append(GrowingText.copied)
        assert GrowingText.copied <= 16 * len(text), (n, GrowingText.copied)
    assert copied[1] <= 10.5 * copied[0], copied
    message, finish = calling.message(text, "stop")
    assert finish == ("stop" if arguments == '{"a": ' else "tool_calls")
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls == [("f", arguments)] * answer.count('"name"')
