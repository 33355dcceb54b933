"""OpenAI tool calling (function calling) on /v1/chat/completions: `tools` and `tool_choice`.

`tools` is OpenAI's list of `{"type": "function", "function": {"name", "description", "parameters"}}`; the tools
are given to the target's chat template (its `tools` argument, as Hugging Face's `apply_chat_template` takes them),
and what the answer may be depends on `tool_choice`:

- "none": text, as without tools.
- a named function (`{"type": "function", "function": {"name": ...}}`): the answer is that function's arguments,
  a JSON value its `parameters` schema accepts, by guided decoding (`dflash_trt.runtime.guided`; exact under
  DFlash as every grammar is). The message has `content` null and one tool call; `finish_reason` stays "stop"
  (OpenAI's, for a forced function).
- "required": a JSON array of one or more `{"name": <a tool's name>, "parameters": <its arguments>}` objects
  (`required_schema`, vLLM's format for it; one at most with `parallel_tool_calls: false`), by guided decoding;
  the message has one tool call per item and `finish_reason` "tool_calls".
- "auto" (the default when tools are given): the model decides, in the format the server was started for
  (`dflash-trt serve --tool-parser`; vLLM's `--tool-call-parser`, trtllm-serve's `--tool_parser`). Its parser
  `hermes` (alias `qwen3`: Hermes 2 Pro, Qwen2.5, Qwen3) reads each `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` of the text as a call (`parse_hermes`; the first only with `parallel_tool_calls: false`) and the
  text before the first one as the content (text after the calls is dropped, as vLLM's parser drops it);
  `llama3_json` (Llama 3.1 / 3.2 / 3.3, vLLM's name) reads an answer that is one or more `{"name": ...,
  "parameters": {...}}` objects, separated by `;`, as calls (`parse_llama3_json`), any other answer as content.
  Without a parser "auto" is refused (a 400 naming the option), as vLLM refuses it, rather than answering text
  that ignores the tools.

A function's `parameters` is a JSON schema of type object, as OpenAI requires (left out or `{}`: no arguments);
the schemas of the functions a request forces are compiled before it is queued (an error names the tool). A
forced call refuses `stop` and `stop_token_ids` (they would cut its JSON), as guided decoding refuses
`min_tokens` and `ignore_eos`.

An answer cut by `max_tokens` is returned as it stands: the named function's arguments as far as they went,
and the "required" array's whole calls (`whole_calls`; with none, the text as content, no tool call), with
`finish_reason` "length".
Streamed, a named function's arguments come as `tool_calls[0].function.arguments` deltas; "required" and "auto"
send their calls whole in the choice's last chunk ("auto" streams the content before the first call,
holding back text that could begin one).
"""

from __future__ import annotations

import difflib
import json
import re
import uuid
from dataclasses import dataclass

from dflash_trt.errors import InvalidRequestError
from dflash_trt.runtime.guided import GuidedDecoding
from dflash_trt.text import partial_suffix

#: `--tool-parser` names: the tool-call format of the target's chat template ("qwen3" is "hermes")
TOOL_PARSERS = ("hermes", "qwen3", "llama3_json")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
#: what Llama 3.1 writes before a call to a built-in tool (a special token: usually not in the decoded text)
PYTHON_TAG = "<|python_tag|>"
#: a function name, as OpenAI restricts it
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: parameters of a function that gives none: an object without properties
NO_PARAMETERS = {"type": "object", "properties": {}}


def call_id() -> str:
    """A new tool call id ("call_" and 24 hex digits, as OpenAI's)."""
    return "call_" + uuid.uuid4().hex[:24]


def tool_call(name: str, arguments: str, index: int | None = None) -> dict:
    """One entry of a message's `tool_calls` (with `index`: a streamed delta's)."""
    out = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return out if index is None else {"index": index, **out}


def _call(obj) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one decoded call: an object with a string "name" and its arguments as an
    object under "arguments" (or "parameters", Llama 3's key; either as JSON text of an object too; absent: {});
    None when `obj` is not such an object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:  # left out, or null: no arguments
        args = {}
    try:
        if isinstance(args, str):
            args = json.loads(args)
        # NaN / Infinity (which Python's decoder reads) are not JSON: such arguments are no call
        return (obj["name"], json.dumps(args, ensure_ascii=False, allow_nan=False)) if isinstance(args, dict) else None
    except (ValueError, RecursionError):
        return None


#: what the text after a JSON error's position can be when the value was cut there: a literal's or a number's
#: beginning (`tru`, `-`, `1.` / `1e+` past the digits read), or a `\u` escape's
_CUT_TAIL = re.compile(r"t(r(u)?)?|f(a(l(s)?)?)?|n(u(l)?)?|-|\.\d*([eE][+-]?\d*)?|[eE][+-]?\d*|u[0-9a-fA-F]{0,3}")


def _ran_out(exc: json.JSONDecodeError, text: str) -> bool:
    """Whether decoding failed because `text` ended inside the JSON value (cut by max_tokens) rather than on a
    character that cannot be JSON: inside a string, or in a literal, number or escape begun at the text's end."""
    rest = text[exc.pos:].rstrip()
    return exc.msg.startswith("Unterminated string") or not rest or _CUT_TAIL.fullmatch(rest) is not None


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The content and the calls of a Hermes-format answer: each `<tool_call>JSON</tool_call>` (`_call`).

    Each call's JSON is decoded from its opening tag on, so an argument string holding "</tool_call>" stays in
    the argument (a tag is only the one after the whole JSON value).

    Args:
        text: the model's answer.
    Returns:
        (content, [(name, arguments as JSON text), ...]): with calls, the content is the text before the first
        `<tool_call>` without its trailing whitespace (None when that is empty); with none (no tag, or a closed
        call whose JSON is not a call), the whole text and []. A last call left unclosed (cut by max_tokens, also
        inside `</tool_call>`) is a call if its JSON is whole, else left out.
    """
    decoder, calls = json.JSONDecoder(), []
    start = text.find(OPEN)
    while start >= 0:
        pos = start + len(OPEN)
        pos += len(text[pos:]) - len(text[pos:].lstrip())
        try:
            obj, end = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError) as exc:  # not JSON, or beyond Python's (4,300-digit integers, depth)
            cut = isinstance(exc, json.JSONDecodeError) and _ran_out(exc, text)
            if cut or text.find(CLOSE, pos) < 0:  # cut, or a last unclosed call: left out
                break
            return text, []  # a closed call that is not JSON
        rest = text[end:].lstrip()
        if rest.startswith(CLOSE):
            call = _call(obj)
            if call is None:
                return text, []
            calls.append(call)
            start = text.find(OPEN, len(text) - len(rest) + len(CLOSE))
            continue
        if len(rest) == partial_suffix(rest, (CLOSE,)):  # the text ends in the JSON, or inside its closing tag
            call = _call(obj)
            calls += [call] if call is not None else []
            break
        if text.find(CLOSE, end) >= 0:  # something else before the tag: not a call
            return text, []
        break  # a last unclosed call followed by text: left out
    if not calls:
        return text, []
    return text[:text.index(OPEN)].rstrip() or None, calls


def _moved_refs(schema, to: str):
    """`schema` with each local `$ref` ("#...") made relative to the JSON pointer `to` (where it is moved)."""
    if isinstance(schema, dict):
        return {k: (to + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _moved_refs(v, to))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_moved_refs(v, to) for v in schema]
    return schema


def parse_llama3_json(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The content and the calls of a Llama 3.1 JSON tool-call answer (vLLM's `llama3_json`): the answer (after
    whitespace and an optional `<|python_tag|>`) is one or more `{"name": ..., "parameters": {...}}` objects
    (`_call` reads each: "arguments" works too) separated by `;`.

    Returns:
        (None, calls) when the whole answer is such calls (a last one cut by max_tokens left out, if others are
        whole); else (the whole text, []).
    """
    body = text.strip()
    body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return text, []
    decoder, pos, calls = json.JSONDecoder(), 0, []
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError) as exc:  # the text ran out inside an object (cut), or is not JSON
            cut = body[pos] == "{" and isinstance(exc, json.JSONDecodeError) and _ran_out(exc, body)
            return (None, calls) if calls and cut else (text, [])
        call = _call(obj)
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


#: per `--tool-parser`: the function reading an answer's content and calls
PARSE = {"hermes": parse_hermes, "qwen3": parse_hermes, "llama3_json": parse_llama3_json}


def whole_calls(text: str) -> list[dict]:
    """The calls a "required" answer cut by max_tokens holds whole: the `{"name", "parameters"}` objects its JSON
    array (`required_schema`) completed before the cut, in order ([] when none)."""
    decoder, out = json.JSONDecoder(), []
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        return out
    i += 1
    while True:
        i += len(text[i:]) - len(text[i:].lstrip())
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            return out
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item):
            return out
        out.append(item)
        i += len(text[i:]) - len(text[i:].lstrip())
        if not text.startswith(",", i):
            return out
        i += 1


def required_schema(tools: tuple[dict, ...], parallel: bool = True) -> dict:
    """The JSON schema of a "required" answer: an array of 1 (or, `parallel`, more) objects
    {"name": a tool's name, "parameters": what that tool's parameters schema accepts}. Each tool's schema sits
    under `$defs/tool_<i>`, its local `$ref`s ("#/$defs/...", pydantic's nested models) rewritten to point there."""
    defs = {f"tool_{i}": _moved_refs(t["parameters"], f"#/$defs/tool_{i}") for i, t in enumerate(tools)}
    items = [{"type": "object", "properties": {"name": {"const": t["name"]}, "parameters": {"$ref": f"#/$defs/tool_{i}"}},
              "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(tools)]
    schema = {"type": "array", "items": {"anyOf": items}, "minItems": 1, "$defs": defs}
    return schema if parallel else {**schema, "maxItems": 1}


#: the fields of a chat function tool and of its function (OpenAI's; another field is refused, naming it)
TOOL_FIELDS = ("type", "function")
FUNCTION_FIELDS = ("name", "description", "parameters", "strict")


def unknown_field(given: dict, known: tuple[str, ...]) -> str:
    """For the first key of `given` not in `known`: "field 'K', which a function tool does not take (it takes
    ...); did you mean 'F'?" (the closest known name, when one is close); "" when every key is known."""
    unknown = next((str(k) for k in given if k not in known), None)
    if unknown is None:
        return ""
    close = difflib.get_close_matches(unknown, known, n=1)
    return (f"field {unknown!r:.60}, which a function tool does not take (it takes {', '.join(known)})"
            + (f"; did you mean {close[0]!r}?" if close else ""))


def _check_tools(tools) -> tuple[dict, ...]:
    """`tools` as (name, description, parameters) dicts of its functions.

    Raises:
        InvalidRequestError (param "tools"): not a list of function tools, a field a function tool does not have
            (`TOOL_FIELDS`, `FUNCTION_FIELDS`: "paramters" is named, not dropped), a bad or repeated name, parameters that
            are not a JSON schema of type object, or keywords guided decoding refuses (`check_schema`; the schemas
            are compiled by `ToolCalling.compile`).
    """
    def bad(message: str):
        return InvalidRequestError(f"tools: {message}", param="tools")

    if not isinstance(tools, list):
        raise bad(f'give a list of {{"type": "function", "function": {{"name": ...}}}} objects, got {tools!r:.60}')
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad(f'tool {i} is not {{"type": "function", "function": {{...}}}} (the only tool type supported)')
        fn = tool["function"]
        for where, given, known in (("", tool, TOOL_FIELDS), ("function ", fn, FUNCTION_FIELDS)):
            unknown = unknown_field(given, known)
            if unknown:  # a misspelt "parameters" would have dropped the schema without a word
                raise bad(f"tool {i} has the {where}{unknown}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad(f"tool {i} has the name {name!r}; a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -")
        if name in out:
            raise bad(f"two tools are named {name!r}; give each function its own name")
        params = fn.get("parameters")
        params = NO_PARAMETERS if params is None or params == {} else params  # left out, null or {}: no arguments
        if not isinstance(params, dict) or params.get("type") != "object":
            raise bad(f"tool {name!r} has parameters {json.dumps(params)[:60]}; a function's parameters are a JSON "
                      'schema of type object ({"type": "object", "properties": {...}}), or left out for none')
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise bad(f"tool {name!r} has a description that is not a string")
        if not isinstance(fn.get("strict", False), (bool, type(None))):
            raise bad(f"tool {name!r} has strict {json.dumps(fn['strict'])[:40]}; give true, false or null")
        try:
            GuidedDecoding(json=params)
        except InvalidRequestError as exc:
            raise bad(f"tool {name!r} parameters: {exc}") from None
        out[name] = {"name": name, "description": description, "parameters": params}
    return tuple(out.values())


@dataclass(frozen=True)
class ToolCalling:
    """The tool calling of one chat request (`from_request`).

    Attributes:
        tools: the functions ({"name", "description", "parameters"}), in the request's order.
        choice: "none", "auto", "required", or "function" (`name` is the function's).
        parser: the server's `--tool-parser` (for "auto").
        parallel: `parallel_tool_calls` (False: "required" makes one call at most).
    """

    tools: tuple[dict, ...]
    choice: str
    name: str | None = None
    parser: str | None = None
    parallel: bool = True

    @classmethod
    def from_request(cls, tools, tool_choice, parallel_tool_calls, parser: str | None,
                     response_format: bool) -> "ToolCalling | None":
        """The request's tool calling, or None when it has none (no tools, or tool_choice "none" without tools).

        Args:
            tools, tool_choice, parallel_tool_calls: the request's fields as sent (None: left out).
            parser: the server's `--tool-parser`, or None.
            response_format: whether the request has a response_format other than text.
        Raises:
            InvalidRequestError: bad tools (param "tools"); a tool_choice that is not one of the four, names no
                given tool, comes without tools, is "auto" on a server without a parser, or forces a call together
                with a response_format (param "tool_choice").
        """
        if tools is None or tools == []:
            if tool_choice not in (None, "none"):
                raise InvalidRequestError(f"tool_choice {tool_choice!r} needs tools; give tools, or leave tool_choice "
                                          "out", param="tool_choice")
            return None
        checked = _check_tools(tools)
        choice = "auto" if tool_choice is None else tool_choice
        name = None
        if isinstance(choice, dict):
            fn = choice.get("function") if choice.get("type") == "function" else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str):
                raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                          f'"function": {{"name": ...}}}}, got {choice!r:.80}', param="tool_choice")
            if name not in {t["name"] for t in checked}:
                raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not in tools "
                                          f"({', '.join(t['name'] for t in checked)})", param="tool_choice")
            choice = "function"
        elif choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f'tool_choice must be "none", "auto", "required" or a named function, got '
                                      f"{choice!r:.80}", param="tool_choice")
        if choice == "auto" and parser is None:
            raise InvalidRequestError(
                'tool_choice "auto" (the default with tools) needs a tool-call parser for the target\'s format: start '
                f"the server with --tool-parser ({', '.join(TOOL_PARSERS)}), or ask for tool_choice \"required\" or a "
                'named function (guided decoding, any target), or "none"', param="tool_choice")
        if choice in ("function", "required") and response_format:
            raise InvalidRequestError(f"tool_choice {tool_choice!r:.60} fixes the answer's format (the tool call), so "
                                      "it cannot have a response_format too; leave one of them out",
                                      param="tool_choice")
        return cls(checked, choice, name, parser, parallel_tool_calls is not False)

    def template_tools(self) -> list[dict]:
        """The tools as the chat template takes them (OpenAI's objects, `apply_chat_template(tools=...)`)."""
        return [{"type": "function", "function": {k: v for k, v in t.items() if v is not None}} for t in self.tools]

    def forced(self) -> tuple[dict, ...]:
        """The functions a call is forced among ("function": its one; "required": all; else none)."""
        if self.choice == "function":
            return tuple(t for t in self.tools if t["name"] == self.name)
        return self.tools if self.choice == "required" else ()

    def compile(self, grammars) -> None:
        """Compile the forced functions' parameters schemas one by one with `grammars` (a
        `dflash_trt.runtime.guided.Grammars`; cached there), so that a schema XGrammar refuses is named.

        Raises:
            InvalidRequestError (param "tools"): naming the tool and XGrammar's message.
        """
        for t in self.forced():
            try:
                grammars.compile(GuidedDecoding(json=t["parameters"]))
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"tools: tool {t['name']!r} parameters: {exc}", param="tools") from None

    def guided(self) -> GuidedDecoding | None:
        """The grammar a forced call follows ("function": its parameters; "required": `required_schema`)."""
        if self.choice == "function":
            return GuidedDecoding(json=next(t["parameters"] for t in self.tools if t["name"] == self.name))
        if self.choice == "required":
            return GuidedDecoding(json=required_schema(self.tools, self.parallel))
        return None

    def calls(self, text: str, finish_reason: str) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, [(name, arguments JSON text), ...]) of a whole answer."""
        if self.choice == "function":
            return None, [(self.name, text)]
        if self.choice == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut by max_tokens: its whole calls, or (none) the text
                items = whole_calls(text)
                if not items:
                    return text, []
            return None, [(it["name"], json.dumps(it["parameters"], ensure_ascii=False)) for it in items]
        if self.choice == "auto":
            content, calls = PARSE[self.parser](text)
            return content, calls if self.parallel else calls[:1]
        return text, []

    def message(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """A choice's `message` and `finish_reason` for its answer `text` (finished for `finish_reason`)."""
        content, calls = self.calls(text, finish_reason)
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [tool_call(n, a) for n, a in calls]
        return msg, _finish(self.choice, calls, finish_reason)

    def stream(self) -> "ToolStream":
        """The state that turns one streamed choice's text deltas into chat deltas."""
        return ToolStream(self)


def _finish(choice: str, calls: list, finish_reason: str) -> str:
    """"tool_calls" for the calls of "required" / "auto" that ended at a stop token; else `finish_reason`."""
    return "tool_calls" if calls and choice != "function" and finish_reason == "stop" else finish_reason


def _content_end(parser: str, text: str) -> int:
    """How much of an "auto" answer's text so far is surely content, in the format of `parser`: hermes: up to a
    `<tool_call>`, or a text end that could begin one, without the whitespace before it (the content before a
    call loses it); llama3_json: nothing while the answer (past whitespace) could be JSON calls, else all of it."""
    if parser == "llama3_json":
        head = text.lstrip()
        maybe_calls = not head or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)
        return 0 if maybe_calls else len(text)
    i = text.find(OPEN)
    body = text[:i] if i >= 0 else text[:len(text) - partial_suffix(text, (OPEN,))]
    return len(body.rstrip())


class ToolStream:
    """One streamed choice under tool calling: `delta(text)` for each text delta, `last(rest, finish)` for its end.
    The deltas joined give the message `ToolCalling.message` gives for the whole text."""

    def __init__(self, calling: ToolCalling):
        self.calling, self.text, self.sent = calling, "", 0
        self.id = call_id()

    def opening(self) -> dict:
        """The choice's first delta: the role (and, for a named function, its call with empty arguments)."""
        if self.calling.choice == "function":
            return {"role": "assistant", "content": None, "tool_calls": [
                {"index": 0, "id": self.id, "type": "function",
                 "function": {"name": self.calling.name, "arguments": ""}}]}
        return {"role": "assistant", "content": ""}

    def delta(self, text: str) -> dict:
        """The chat delta to send for the choice's next text (may be {}: held back until `last`)."""
        self.text += text
        if self.calling.choice == "function":
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        if self.calling.choice == "required":
            return {}
        end = _content_end(self.calling.parser, self.text) if self.calling.choice == "auto" else len(self.text)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return {"content": out} if out else {}

    def last(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """The choice's last delta (the rest of its content, its calls) and its finish_reason."""
        self.text += text
        if self.calling.choice == "function":
            return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), finish_reason
        content, calls = self.calling.calls(self.text, finish_reason)
        rest = (content or "")[self.sent:]
        out = {"content": rest} if rest else {}
        if calls:
            out["tool_calls"] = [tool_call(n, a, i) for i, (n, a) in enumerate(calls)]
        return out, _finish(self.calling.choice, calls, finish_reason)
