"""Streamed chat answers do work linear in the answer's length: a long tool call argument string, a long number in
the arguments, a long run of whitespace before a call (`dflash_trt.serve.tool_stream`), fed a character at a time,
copy a few characters per character, not the whole run again at each delta (`dflash_trt.text.GrowingText`, whose
slices the readers take, counts what they copy); a long reasoning (`dflash_trt.serve.reasoning`) allocates a few
bytes per character (`tracemalloc` counts them), not the whole text again at each delta; and the deltas stay
exactly what they were."""

from __future__ import annotations

import random
import sys
import tracemalloc

import pytest

from dflash_trt.serve.chat import ChatAnswers
from dflash_trt.serve.reasoning import END, START, ReasoningStream, split_reasoning
from dflash_trt.serve.tools import ToolCalling
from dflash_trt.text import GrowingText, partial_suffix
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


def python_calls(step) -> int:
    """How many Python function calls and generator resumes `step()` makes, C functions' calls included (what
    `sys.setprofile` sees): a count of the work a scan does in Python, which copies and allocates nothing (a
    generator over a list), so neither `GrowingText.copied` nor `tracemalloc` sees it. Exact and the same on any
    machine."""
    n = 0

    def profile(frame, event, arg):
        nonlocal n
        n += event in ("call", "c_call")

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(old)
    return n


#: (tool_choice "required" or the --tool-parser's format under "auto"; the answer, "{keys}" where the run of keys
#: goes): a call object with many top-level keys besides its name and arguments (ignored), after them or before
CALL_KEYS = [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "x"}{keys}}</tool_call>'),
    ("hermes", '<tool_call>{"k": 0{keys}, "name": "f", "arguments": {"a": "x"}}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": "x"}{keys}}'),
    ("required", '[{"name": "f", "parameters": {"a": "x"}{keys}}]'),
]


@pytest.mark.parametrize("fmt, answer", CALL_KEYS, ids=[f"{f}-{a[:16]}" for f, a in CALL_KEYS])
def test_a_call_with_many_keys_streams_in_linear_work(fmt, answer):
    """A call object with 500, then 1,000 top-level keys, streamed 4 characters per delta (about a token each):
    the deltas join to the message, and the Python calls made (`python_calls`) are under 60 per character (~30), so
    twice the keys make about twice the calls. (The call's state scanned every member read so far, several times,
    at each delta: ~n², 160 calls per character already at 500 keys, 47 s for 8,000 keys a character per delta. Keys
    before the name kept the call pending, which never scanned: that layout is here so it stays so.)"""
    calling = ToolCalling(TOOLS, "required" if fmt == "required" else "auto", None, "hermes" if fmt == "required"
                          else fmt)
    calls = []
    for n in (500, 1_000):
        text = answer.replace("{keys}", "".join(f', "k{i}": {i}' for i in range(1, n + 1)))
        parts = [text[i:i + 4] for i in range(0, len(text), 4)]
        calls.append(python_calls(lambda: check_joined(calling, text, parts, "stop")))
        assert calls[-1] <= 60 * len(text), (n, calls[-1])
    assert calls[1] <= 2.2 * calls[0], calls
    message, finish = calling.message(text, "stop")
    assert finish == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("f", '{"a": "x"}')]


def allocated(step, parts) -> int:
    """The bytes `step(part)` allocates for each of `parts`, summed: each call's peak of Python's traced memory
    (`tracemalloc`) above what was traced before it. What a delta copies counts in it, however the copy is made (a
    `str` grown by `+=`, a slice, a split): a delta that copies the whole text so far adds the text's length."""
    tracemalloc.start()
    try:
        total = 0
        for part in parts:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            step(part)
            total += tracemalloc.get_traced_memory()[1] - before
        return total
    finally:
        tracemalloc.stop()


class Joined:
    """The reasoning, content and tool call arguments of a choice's chat deltas, joined; `opened`: how many deltas
    had the role. Keeps the deltas' strings only (a list of deltas kept would add its dicts to what they allocate)."""

    def __init__(self):
        self.reasoning, self.content, self.arguments, self.opened = [], [], [], 0

    def add(self, delta: dict | None) -> None:
        if delta:
            self.opened += "role" in delta
            self.reasoning.append(delta.get("reasoning_content", ""))
            self.content.append(delta.get("content") or "")
            for call in delta.get("tool_calls", ()):
                self.arguments.append(call["function"]["arguments"])

    def __iter__(self):
        return iter(("".join(self.reasoning), "".join(self.content), "".join(self.arguments), self.opened))


#: (--reasoning-parser; the answer, "{n}" where the long runs go)
REASONING = [
    ("qwen3", "<think>{n}"),  # cut by max_tokens inside the reasoning
    ("qwen3", "{n}<think>{n}</think>{n}"),
    ("qwen3", "<think>{n}</think><{n}"),  # a "<" after: held back a delta, while it may begin a tag
    ("deepseek-r1", "{n}</think>{n}"),
    ("deepseek-r1", "<think>{n}"),
]


@pytest.mark.parametrize("parser, answer", REASONING, ids=[f"{p}-{a}" for p, a in REASONING])
def test_a_long_reasoning_streams_in_linear_work(parser, answer):
    """An answer with 5k, then 50k characters of reasoning (and of content around it), streamed a character per
    delta through the reasoning split: the reasoning and content deltas join to the message's, and what the deltas
    allocate is under 256 bytes per character (~65: the lists the test keeps them in), so 10 times the answer
    allocates about 10 times as much (the split was made again over the whole text at every delta, which copied it
    several times: ~n² bytes, ~2.7k per character for 5k characters).

    A count of bytes and not a clock, for the reason `test_a_long_argument_streams_in_linear_work` gives; bytes
    allocated and not `GrowingText.copied`, because the reasoning split keeps no text to slice (it holds back only
    what may still begin a tag), so what it copies is counted however it copies."""
    answers = ChatAnswers(None, parser, None)
    allocs = []
    for n in (5_000, 50_000):
        text = answer.replace("{n}", "x" * n)
        s, joined = answers.stream(), Joined()
        joined.add(s.opening())
        allocs.append(allocated(lambda c: joined.add(s.delta(c)), text))
        joined.add(s.last("", "stop")[0])
        message, _ = answers.message(text, "stop")
        assert tuple(joined) == (message["reasoning_content"] or "", message["content"] or "", "", 1)
        assert allocs[-1] <= 256 * len(text), (n, allocs[-1])
    assert allocs[1] <= 10.5 * allocs[0], allocs


def stream_allocated(answers: ChatAnswers, text: str) -> tuple[int, tuple]:
    """(the bytes the deltas of `text`, a character each, allocate (`allocated`); the deltas joined (`Joined`))."""
    s, joined = answers.stream(), Joined()
    joined.add(s.opening())
    total = allocated(lambda c: joined.add(s.delta(c)), text)
    joined.add(s.last("", "stop")[0])
    return total, tuple(joined)


@pytest.mark.parametrize("tool_parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("parser, answer", [("qwen3", "<think>{n}"), ("deepseek-r1", "{n}")], ids=["qwen3", "deepseek-r1"])
def test_tool_readers_do_no_work_during_reasoning(tool_parser, parser, answer):
    """An answer that is 5k, then 50k characters of reasoning, a character per delta, with tools ("auto"): the
    deltas are those of the same stream without tools (the tool reader is given "" each delta: the content), and
    what they allocate is the same to within 2 KB in all, so the tool reader does nothing per delta. (It looked at
    the text's end for a <tool_call> every delta, or matched the empty text for whitespace before a call: ~560
    bytes per delta under hermes, ~1.2k under llama3_json.)"""
    with_tools = ChatAnswers(ToolCalling(TOOLS, "auto", None, tool_parser), parser, None)
    plain = ChatAnswers(None, parser, None)
    for n in (5_000, 50_000):
        text = answer.replace("{n}", "x" * n)
        (allocs, joined), (plain_allocs, plain_joined) = stream_allocated(with_tools, text), stream_allocated(plain, text)
        assert joined == plain_joined == ("x" * n, "", "", 1)
        assert abs(allocs - plain_allocs) <= 2000, (n, allocs, plain_allocs)


def test_hermes_content_streams_at_a_small_cost_per_delta():
    """Content after the reasoning under hermes ("auto"), 5k then 50k characters, a character per delta: the
    deltas join to the message and allocate under 256 bytes per character of the answer (~140, ~65 without tools;
    it was ~680: the reader looked at the text's last 11 characters, joined from their pieces, for the beginning of
    a <tool_call> at every delta; now only from the text's last "<", when it is that near the end)."""
    answers = ChatAnswers(ToolCalling(TOOLS, "auto", None, "hermes"), "deepseek-r1", None)
    for n in (5_000, 50_000):
        text = "x" * n + "</think>" + "y " * (n // 2) + "<tool_"  # (each space held back a delta: it may end the
        allocs, joined = stream_allocated(answers, text)  # content, if a call follows; so is the tag's beginning)
        message, _ = answers.message(text, "stop")
        assert joined == ("x" * n, "y " * (n // 2) + "<tool_", "", 1) and message["content"] == joined[1]
        assert allocs <= 256 * len(text), (n, allocs / len(text))


def test_reasoning_then_a_long_call_streams_in_linear_work():
    """Both at once (qwen3's reasoning split, then Hermes tool calls read from the content): 5k, then 50k characters
    of reasoning, of content and of a call's argument, a character per delta: the deltas are the message's, and the
    bytes the deltas allocate and the characters the tool reader copies are both bounded per character (the old
    reasoning split allocated ~14k bytes per character here for 5k)."""
    calling = ToolCalling(TOOLS, "auto", None, "hermes")
    answers = ChatAnswers(calling, "qwen3", None)
    allocs, copied = [], []
    for n in (5_000, 50_000):
        text = ("<think>" + "x" * n + "</think>\n" + " " * n + 'Sure. <tool_call>{"name": "f", "arguments": {"a": "'
                + "y" * n + '"}}</tool_call>')
        s, joined = answers.stream(), Joined()
        joined.add(s.opening())
        GrowingText.copied = 0
        allocs.append(allocated(lambda c: joined.add(s.delta(c)), text[:-1]))
        last, finish = s.last(text[-1], "stop")
        joined.add(last)
        copied.append(GrowingText.copied)
        message, want_finish = answers.message(text, "stop")
        assert finish == want_finish == "tool_calls"
        assert tuple(joined) == (message["reasoning_content"], message["content"],
                                 message["tool_calls"][0]["function"]["arguments"], 1)
        assert tuple(joined)[:3] == ("x" * n, "\n" + " " * n + "Sure.", '{"a": "' + "y" * n + '"}')
        # (the tool reader's work per delta in the argument peaks at ~1.2k bytes: a regular expression's match)
        assert allocs[-1] <= 2000 * len(text) and copied[-1] <= 32 * len(text), (n, allocs[-1], copied[-1])
    assert allocs[1] <= 10.5 * allocs[0] and copied[1] <= 10.5 * copied[0], (allocs, copied)


@pytest.mark.parametrize("at_start", [False, True], ids=["qwen3", "deepseek-r1"])
def test_the_reasoning_split_sends_what_the_split_of_the_text_so_far_adds(at_start):
    """Each delta of the reasoning split (which looks at each delta's text once) is exactly what `split_reasoning`
    of the text so far, less an end that may still begin a tag, adds to the last delta's: answers made of tags,
    pieces of tags and text, cut at random points (a fixed seed)."""
    rng = random.Random(2)
    atoms = ["<think>", "</think>", "<", "</", "<th", "</thin", "<think", "x", "> ", "\n"]
    for _ in range(400):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if text else []
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]
        s, seen, sent = ReasoningStream(at_start), "", ("", "")
        for i, part in enumerate(parts):
            seen += part
            last = i == len(parts) - 1
            got = s.last(part) if last else s.delta(part)
            now = split_reasoning(seen[:len(seen) - (0 if last else partial_suffix(seen, (START, END)))], at_start)
            assert got == (now[0][len(sent[0]):], now[1][len(sent[1]):]), (text, parts, i)
            sent = now
        assert sent == split_reasoning(text, at_start)
