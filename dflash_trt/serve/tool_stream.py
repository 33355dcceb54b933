"""Tool calls read from an answer's text as it grows, so a streamed answer sends each call as it is written.

`CallsReader` reads an answer in one tool-call format (`FORMATS`: Hermes' `<tool_call>{...}</tool_call>`, Llama 3's
JSON calls, the JSON array of tool_choice "required") as its text grows, and says at each point what is sure: the
content that will not become a call, and the calls so far, each with its name and its arguments' text as far as
they go. What it says only grows, so the stream never sends what it must take back; and the whole answer's message
(`read_answer`) is the same reading run to the end, so the deltas of any split join to it exactly.

A call object is `{"name": ..., "arguments": {...}}` ("parameters", Llama 3's key, works too; the arguments may
also be JSON text of an object, or null for none; other keys are ignored, though in llama3_json none may
come between the name and the arguments). Its arguments' text is canonical:
`json.dumps(arguments, ensure_ascii=False)`, written as far as it is sure (`dflash_trt.serve.json_stream`).

A call is a call from the moment its name is whole (the object's first key "name" with a string value, one
without a lone surrogate: a response could not carry it). In llama3_json, where no tag marks a call (so an
ordinary JSON answer may look like one), it is one only from the moment the next key is whole too and is
"arguments" or "parameters", and only with the name of one of the request's tools (`CallsReader`'s `names`): an
answer `{"name": "Alice", "age": 30}` is content, not a call to "Alice" (vLLM's parser also wants the arguments
key; it takes any name). Before that, an object that goes wrong is not a call: the first one makes the whole
answer content (with Hermes, text that only looked like a call), a later one ends the calls there (what follows
is dropped, as text after the calls is). After it, a call that goes wrong (the text cut by max_tokens or a stop
string, or not JSON any more) keeps the arguments as far as they were sure, without their closing brace (held
back until the call object closes), so they are not valid JSON, as OpenAI's call cut by max_tokens; the calls end
there. An object whose first key is not "name" is a call once it is whole, if its name and arguments are one's
(in llama3_json, with an arguments key).

finish_reason (`finish_reason`) is "tool_calls" only when the answer stopped with calls and every one is whole
(its arguments valid JSON); when the last call went wrong it stays the engine's ("stop" / "length"), so a client
knows the call is not usable (the Responses API marks its item "incomplete"). The stream's last chunk carries
the same finish_reason as the message.

Streamed, the work is linear in the answer's length: the text and each call's canonical arguments are kept as
pieces (`dflash_trt.text.GrowingText`), each delta reads on only from where the last one stopped (past the digits of
a number not yet whole, and the whitespace before a call in the formats without a tag; Hermes' tag looked for only
from the text's last "<"; an empty delta, every delta of a reasoning, not read at all), a call's state looks at
each of its object's members once (however many keys it has), and `CallReader.arguments(since)` hands out only the
arguments written since what was sent.
"""

from __future__ import annotations

import json
import re
import uuid

from dflash_trt.serve.json_stream import JsonReader, NotJson
from dflash_trt.text import GrowingText

OPEN, CLOSE = "<tool_call>", "</tool_call>"
#: what Llama 3.1 writes before a call to a built-in tool (a special token: usually not in the decoded text)
PYTHON_TAG = "<|python_tag|>"
#: the formats `CallsReader` reads: per `--tool-parser` ("qwen3" is "hermes"), and "required" (tool_choice's array)
FORMATS = {"hermes": "hermes", "qwen3": "hermes", "llama3_json": "llama3_json", "required": "required"}
_ARGUMENT_KEYS = ("arguments", "parameters")
#: where a call stands (`CallReader.state`)
PENDING, NOT_A_CALL, OPEN_CALL, BROKEN, WHOLE = "pending", "not a call", "open", "broken", "whole"

#: what comes before the first call and between calls, per format (the position after it is where a call starts)
_LLAMA3_START = re.compile(r"[ \t\n\r]*(<\|python_tag\|>)?[ \t\n\r]*")
_LLAMA3_NEXT = re.compile(r"[ \t\n\r;]*")
_ARRAY_START = re.compile(r"[ \t\n\r]*(\[[ \t\n\r]*)?")
_ARRAY_NEXT = re.compile(r"[ \t\n\r]*(,[ \t\n\r]*)?")
#: what may follow the mark ("[", ",", `<|python_tag|>`) of one of those before the call
_AFTER_MARK = re.compile(r"[ \t\n\r]*")
#: a lone surrogate (a JSON escape can write one): UTF-8 cannot carry it, so a name with one is not a function's
_SURROGATE = re.compile("[\ud800-\udfff]")


def call_id() -> str:
    """A new tool call id ("call_" and 24 hex digits, as OpenAI's)."""
    return "call_" + uuid.uuid4().hex[:24]


def _canonical_object(text: str) -> str | None:
    """The canonical text of the JSON object that `text` is (whitespace around it allowed), or None."""
    reader = JsonReader(object_only=True)
    try:
        reader.read(text, final=True)
    except NotJson:
        return None
    return reader.out if not text[reader.pos:].strip(" \t\n\r") else None


class CallReader:
    """One call object of an answer, from position `start` of its text, read as the text grows (`read`).

    `keyed` (llama3_json, whose calls no tag marks): the object is a call only with an arguments key, the one right
    after its name when "name" comes first; `names` (None: any): the names a call may have."""

    def __init__(self, start: int, keyed: bool = False, names: frozenset[str] | None = None):
        self.json = JsonReader(start, object_only=True)
        self.keyed, self.names = keyed, names
        self.failed = False  # the text cannot go on as the object (or ended inside it)
        self._name_ok: bool | None = None  # whether the "name" member is a name (`_has_name`), once it is whole
        self._whole: tuple[str | None] | None = None  # `_whole_arguments`, once the object is whole
        self._opens = ""  # the first character of the arguments' value, once written
        # the members looked at so far (`_look`): how many, the "name" one, the first arguments one, how many of
        # those (a state reads them from here, not by a scan of every member at each delta: linear in the object)
        self._seen, self._name, self._args, self._n_args = 0, None, None, 0

    def read(self, text: str, final: bool, base: int = 0) -> None:
        """Read the text so far on (`text`: the text from position `base` on, `base` <= `self.json.pos`); `final`:
        it ends here."""
        if not self.failed:
            try:
                self.json.read(text, final, base)
            except NotJson:
                self.failed = True

    def _look(self) -> None:
        """Note the members read since the last look (each member once): the "name" one (a key is in an object
        once), the first arguments one and how many there are. A member is a list the reader fills in as its value
        is read (`JsonReader.members`), so the ones noted stay current."""
        members = self.json.members
        for m in members[self._seen:] if self._seen < len(members) else ():
            if m[0] == "name":
                self._name = m
            elif m[0] in _ARGUMENT_KEYS:
                self._n_args += 1
                if self._args is None:
                    self._args = m
        self._seen = len(members)

    def _name_member(self):
        self._look()
        return self._name

    def _arguments_member(self):
        self._look()
        return self._args

    def _arguments_open(self, args) -> str:
        """The first character of the value of `args` (the arguments member), "" until it is written."""
        if not self._opens and args[1] is not None:
            self._opens = self.json.written(args[1], args[1] + 1)
        return self._opens

    def _has_name(self) -> bool:
        """Whether the object has a "name" member whose value is a whole string, one a name can be (no lone
        surrogate: a response could not carry it; one of `names`, when given)."""
        if self._name_ok is None:
            name = self._name_member()
            if name is None or name[2] is None:
                return False
            value = json.loads(self.json.written(name[1], name[2]))
            self._name_ok = isinstance(value, str) and not _SURROGATE.search(value) and (
                self.names is None or value in self.names)
        return self._name_ok

    def _named(self) -> bool:
        """Whether the object's first key is "name" and its value a whole string, a name (`_has_name`), and (`keyed`)
        the next key, whole, an arguments key: the call is a call from here."""
        members = self.json.members
        if not members or members[0][0] != "name" or not self._has_name():
            return False
        return not self.keyed or (len(members) > 1 and members[1][0] in _ARGUMENT_KEYS)

    def _unkeyed(self) -> bool:
        """`keyed`: whether what was read keeps the object from being a call for want of an arguments key: the key
        after a first "name" is another, or the object is whole without one."""
        if not self.keyed:
            return False
        members = self.json.members
        if len(members) > 1 and members[0][0] == "name" and members[1][0] not in _ARGUMENT_KEYS:
            return True
        return self.json.done and self._arguments_member() is None

    def _spoilt(self) -> bool:
        """Whether what was read already keeps the object from being a call: both argument keys, or arguments
        that are not an object, JSON text or null."""
        args = self._arguments_member()
        if self._n_args > 1:
            return True
        return args is not None and self._arguments_open(args) not in ('', '{', '"', 'n')

    def _whole_arguments(self) -> str | None:
        """The canonical text of the whole object's arguments ("{}" for none), or None when they are not an
        object's."""
        if self._whole is None:
            args = self._arguments_member()
            if args is None:
                value = "{}"
            else:
                value = self.json.written(args[1], args[2])
                if value[0] == '"':  # the arguments as JSON text
                    value = _canonical_object(json.loads(value))
                elif value == "null":
                    value = "{}"
            self._whole = (value,)  # (the object is whole: they stay so)
        return self._whole[0]

    @property
    def state(self) -> str:
        """PENDING (may still become a call), NOT_A_CALL, OPEN_CALL (a call, not yet whole), BROKEN (a call that
        went wrong: its arguments stop where they were sure) or WHOLE."""
        named = self._named()
        if self.failed or (named and self._spoilt()):
            return BROKEN if named else NOT_A_CALL
        if not named and self._unkeyed():
            return NOT_A_CALL
        if not self.json.done:
            return OPEN_CALL if named else PENDING
        if not self._has_name() or self._spoilt() or self._whole_arguments() is None:
            return BROKEN if named else NOT_A_CALL
        return WHOLE

    @property
    def name(self) -> str:
        """The call's name (once it is a call)."""
        name = self._name_member()
        return json.loads(self.json.written(name[1], name[2]))

    def arguments(self, since: int = 0) -> str:
        """The arguments' canonical text as far as it is sure, from character `since` on (what was not sent yet;
        it only grows, so the pieces join to the whole): whole once the call is, else the text of an object being
        written without its last character (its closing brace once it is whole); "" before they begin, or while
        they are JSON text or null (those come whole). Takes time in the length of what it returns (once whole, in
        the arguments' length: once per call)."""
        if self.state == WHOLE:
            return self._whole_arguments()[since:]
        args = self._arguments_member()
        if args is None or args[1] is None:
            return ""
        start, end = args[1], args[2]
        if self._arguments_open(args) != "{":
            return ""
        return self.json.written(start + since, end - 1 if end is not None else self.json.out_len)


class CallsReader:
    """The content and the calls of an answer in format `fmt` (a `FORMATS` value), read as its text grows: `feed`
    each piece (`final` with the last); `content_end` and `calls` say what is sure so far (and, after the last
    piece, what the answer is: `answer`, `whole`). `parallel` False: the first call only. `names`: the request's
    tools' names, which a llama3_json call's name must be one of (no tag marks its calls: a JSON answer whose
    "name" is no tool's is data); the other formats take any name (None: any)."""

    def __init__(self, fmt: str, parallel: bool = True, names=None):
        self.fmt, self.parallel = fmt, parallel
        self.keyed = fmt == "llama3_json"  # a call needs an arguments key (`CallReader`)
        self.names = frozenset(names) if names is not None and self.keyed else None
        self.text, self.final = GrowingText(), False  # the answer so far (`text.slice(a, b)`)
        # llama3_json, "required": where the text before the next call is read on from (past what was read of it: a
        # long run of whitespace is read once, not again at each delta), and whether its mark ("[", ",",
        # <|python_tag|>) was read
        self.pos, self._marked = 0, False
        self.calls: list[CallReader] = []  # the calls (each a call: open, broken or whole)
        self.reading: CallReader | None = None  # the object being read (pending, or the open call)
        self.mode = "before"  # before the first call; "calls"; "content" (the whole answer is); "end" (no more calls)
        self.opened: int | None = None  # hermes: where the first <tool_call> is
        self._scan = 0  # hermes: where to look for the next <tool_call>
        self._stripped = (0, 0)  # hermes: (an end, that end without the whitespace before it): `content_end`'s memo
        self._last_lt = -1  # hermes: where the text's last "<" is (-1: none), which a <tool_call> must begin at

    def feed(self, text: str, final: bool = False) -> None:
        """Read the answer's next piece of text; `final`: it is the last."""
        if self.fmt == "hermes" and (i := text.rfind("<")) >= 0:
            self._last_lt = len(self.text) + i
        self.text.append(text)
        self.final = final
        while self.mode in ("before", "calls"):
            if self.reading is None:
                start = self._next_call()
                if start is None:
                    break
                self.reading = CallReader(start, self.keyed, self.names)
            call = self.reading
            call.read(self.text.slice(call.json.pos), final, base=call.json.pos)  # the text not read yet
            state = call.state
            if state == PENDING:
                break
            if state == NOT_A_CALL:
                self.reading = None
                self.mode = "content" if not self.calls else "end"
                break
            if not self.calls or self.calls[-1] is not call:
                self.calls.append(call)
                self.mode = "calls"
            if state == OPEN_CALL:
                break
            self.reading = None
            if state == BROKEN or not self.parallel:
                self.mode = "end"
                break
            self.pos = self._scan = call.json.pos
            self._marked = False
        if final and self.mode in ("before", "calls"):
            self.mode = "content" if not self.calls else "end"

    def _next_call(self) -> int | None:
        """Where the next call object starts (its "{", or for Hermes the text after `<tool_call>`), or None: not
        known yet, or (mode set) no more calls."""
        first = not self.calls
        if self.fmt == "hermes":
            if self._last_lt < self._scan:  # no "<" since where the last look stopped: no tag begins there
                self._scan = len(self.text)
                return None
            i = self.text.slice(self._scan).find(OPEN)  # (from where the last look stopped)
            if i < 0:
                self._scan = max(self._scan, len(self.text) - len(OPEN) + 1)
                return None
            i += self._scan
            if first:
                self.opened = i
            return i + len(OPEN)
        pattern = ((_LLAMA3_START if first else _LLAMA3_NEXT) if self.fmt == "llama3_json"
                   else (_ARRAY_START if first else _ARRAY_NEXT))
        if self._marked:
            pattern = _AFTER_MARK
        text = self.text.slice(self.pos)  # the text after the last call not read yet (positions from `pos`)
        m = pattern.match(text)
        end = m.end()
        marked = self._marked or (pattern.groups > 0 and m.group(1) is not None)
        if end == len(text):  # (its whitespace, and mark, read once: they only go on as the pattern does)
            self.pos, self._marked = self.pos + end, marked
            return None
        if text[end] == "{" and (self.fmt == "llama3_json" or marked):
            return self.pos + end
        if first and self.fmt == "llama3_json" and not marked and PYTHON_TAG.startswith(text[end:]):
            self.pos += end  # (only the whitespace before: the tag is matched whole once it is)
            return None  # maybe the tag, cut
        self.mode = "content" if first else "end"
        return None

    def content_end(self) -> int:
        """How much of the text is surely content (the content is `text[:content_end()]`): with calls (or while
        there may be), Hermes' text before the first `<tool_call>` (or a text end that may begin one) without its
        trailing whitespace, nothing in the other formats; without, once known, all of it."""
        n = len(self.text)
        if self.mode == "content":
            return n
        if self.fmt != "hermes":
            return 0
        end = self.opened if self.opened is not None else n - self._partial_open()
        seen, stripped = self._stripped  # the end only grows: look back as far as the last end only (each character
        if end < seen:  # once, not the whole run of whitespace again at each delta)
            seen, stripped = 0, 0
        new = self.text.slice(seen, end)
        i = len(new)
        while i > 0 and new[i - 1].isspace():
            i -= 1
        self._stripped = (end, seen + i if i > 0 else stripped)
        return self._stripped[1]

    def _partial_open(self) -> int:
        """Hermes: the length of the text's longest end that is a proper beginning of `<tool_call>` (what
        `partial_suffix(text, (OPEN,))` says), in time independent of the text and its pieces: such an end begins at
        the text's last "<" (the tag's only one is its first character), so there is none when that is too far back.
        """
        k = len(self.text) - self._last_lt
        if self._last_lt < 0 or k >= len(OPEN):
            return 0
        return k if OPEN.startswith(self.text.slice(self._last_lt)) else 0

    def content(self) -> str | None:
        """The content as it stands: with calls, None when it is empty."""
        content = self.text.slice(0, self.content_end())
        return content or None if self.calls else content

    def answer(self) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, [(name, arguments' canonical JSON text), ...]) as they stand (after the last piece: the
        answer's)."""
        return self.content(), [(c.name, c.arguments()) for c in self.calls]

    @property
    def whole(self) -> bool:
        """Whether every call so far is whole (True with none): after the last piece, False when the calls end at
        one that went wrong (its arguments not valid JSON). Only the last call can be other than whole."""
        return not self.calls or self.calls[-1].state == WHOLE


def read_answer(fmt: str, text: str, parallel: bool = True, names=None) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments' canonical JSON text), ...]) of a whole answer in format `fmt` (`FORMATS`;
    `parallel` False: its first call only; `names`: the tools', for llama3_json), as `CallsReader` reads it."""
    reader = CallsReader(FORMATS[fmt], parallel, names)
    reader.feed(text, final=True)
    return reader.answer()


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, calls) of a Hermes answer: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` is a
    call (`read_answer`); the content is the text before the first, without its trailing whitespace (None when
    empty), or with no call the whole text. Text between and after the calls is dropped."""
    return read_answer("hermes", text)


def parse_llama3_json(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, calls) of a Llama 3.1 JSON answer (vLLM's `llama3_json`): after whitespace and an optional
    `<|python_tag|>`, `{"name": ..., "parameters": {...}}` objects separated by `;` are calls (the arguments key
    right after the name; any name: `read_answer` with `names` takes the tools' only), content None; an answer
    that does not begin with one is content."""
    return read_answer("llama3_json", text)


def finish_reason(reader: CallsReader | None, finish: str) -> str:
    """The finish_reason of an answer that ended for `finish`, its calls read by `reader` ("required" / "auto"; None
    for the others): "tool_calls" when it ended at a stop token with calls, each whole; else `finish` (a call that
    went wrong, by a stop string or JSON that broke off, leaves "stop": the call is not usable)."""
    return "tool_calls" if reader is not None and reader.calls and reader.whole and finish == "stop" else finish


class ToolStream:
    """One streamed choice under tool calling (`calling`: a `dflash_trt.serve.tools.ToolCalling`): `opening()`,
    `delta(text)` for each text delta, `last(rest, finish)` for its end. Content is sent as soon as it cannot
    become a call; a call's first delta has its index, id, type and name (and its arguments so far, often ""),
    the next ones more of its arguments (`CallsReader`). The deltas joined give `ToolCalling.message`'s."""

    def __init__(self, calling):
        self.calling, self.sent = calling, 0
        self.id = call_id()  # a named function's call
        self.reader = calling.reader()
        self.ids: list[str] = []  # the calls sent: their ids
        self.args_sent: list[int] = []  # and how much of their arguments
        self.settled = 0  # the calls before it are whole or broken, and sent

    def opening(self) -> dict | None:
        """The choice's first delta: the role (and, for a named function, its call with empty arguments, content
        null); None when the answer is read for calls ("auto", "required"): whether its content is text or null is
        not known yet, so the role waits for the first delta that says (`dflash_trt.serve.chat.ChatStream`)."""
        if self.calling.choice == "function":
            return {"role": "assistant", "content": None, "tool_calls": [
                {"index": 0, "id": self.id, "type": "function",
                 "function": {"name": self.calling.name, "arguments": ""}}]}
        if self.reader is not None:
            return None
        return {"role": "assistant", "content": ""}

    def delta(self, text: str) -> dict:
        """The chat delta to send for the choice's next text (may be {}: all held back)."""
        if self.calling.choice == "function":
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        if not text:  # (nothing new to read: during reasoning, every delta; no work at all, not a reader's look)
            return {}
        if self.reader is None:
            return {"content": text}
        self.reader.feed(text)
        return self._news()

    def last(self, text: str, finish: str) -> tuple[dict, str]:
        """The choice's last delta (what was held back) and its finish_reason."""
        if self.reader is None:
            return self.delta(text), finish
        self.reader.feed(text, final=True)
        return self._news(), finish_reason(self.reader, finish)

    @property
    def broken(self) -> bool:
        """Whether the calls ended at one that went wrong (after `last`: the last call sent is not usable)."""
        return self.reader is not None and not self.reader.whole

    def _news(self) -> dict:
        """What the reader is sure of that was not sent yet."""
        reader, out = self.reader, {}
        end = reader.content_end()
        if end > self.sent:
            out["content"] = reader.text.slice(self.sent, end)
            self.sent = end
        calls = []
        for i in range(self.settled, len(reader.calls)):  # the calls before `settled` were sent whole
            call = reader.calls[i]
            if i == len(self.ids):
                args = call.arguments()
                self.ids.append(call_id())
                self.args_sent.append(len(args))
                calls.append({"index": i, "id": self.ids[i], "type": "function",
                              "function": {"name": call.name, "arguments": args}})
            elif args := call.arguments(self.args_sent[i]):  # only what is new (linear in the answer)
                calls.append({"index": i, "function": {"arguments": args}})
                self.args_sent[i] += len(args)
            if call is not reader.reading:  # whole or broken: its arguments are all sent
                self.settled = i + 1
        if calls:
            out["tool_calls"] = calls
        return out
