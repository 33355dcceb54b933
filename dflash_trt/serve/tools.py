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
  </tool_call>` of the text as a call (the first only with `parallel_tool_calls: false`) and the text before the
  first one as the content (text between and after the calls is dropped, as vLLM's parser drops it);
  `llama3_json` (Llama 3.1 / 3.2 / 3.3, vLLM's name) reads an answer that begins with `{"name": ...,
  "parameters": {...}}` objects, separated by `;`, as calls (an object is one only with "arguments" or
  "parameters" right after its name, and a tool's name: JSON data is not a call), any other answer as content
  (`dflash_trt.serve.tool_stream`, which also says what becomes of a call that goes wrong).
  Without a parser "auto" is refused (a 400 naming the option), as vLLM refuses it, rather than answering text
  that ignores the tools.

A function's `parameters` is a JSON schema of type object, as OpenAI requires (left out or `{}`: no arguments);
the schemas of the functions a request forces are compiled before it is queued (an error names the tool). A
forced call refuses `stop` and `stop_token_ids` (they would cut its JSON), as guided decoding refuses
`min_tokens` and `ignore_eos`.

An answer cut by `max_tokens` is returned as it stands: the named function's arguments as far as they went; a
"required" or "auto" call cut after its name keeps its arguments as far as they were sure (not valid JSON: their
closing brace is missing), one cut before that is left out (and with no call the text is the content), with
`finish_reason` "length"; "auto" calls cut by a stop string, or whose JSON broke off, likewise, with
`finish_reason` "stop": "tool_calls" only when every call is whole.
Streamed (`tool_stream.ToolStream`), each call comes as it is written, as OpenAI's and vLLM's: a first delta with
its index, id, type and name once the name is whole, then its arguments' text in `function.arguments` deltas;
text that may still become a call (a partial `<tool_call>`, a call's name, the arguments' closing brace) is held
back until it is known, so the deltas join to the message a non-streamed request gets, however the text was cut.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass

from dflash_trt.errors import InvalidRequestError
from dflash_trt.runtime.guided import GuidedDecoding
from dflash_trt.serve.tool_stream import FORMATS, CallsReader, ToolStream, call_id, finish_reason

#: `--tool-parser` names: the tool-call format of the target's chat template ("qwen3" is "hermes")
TOOL_PARSERS = ("hermes", "qwen3", "llama3_json")
#: a function name, as OpenAI restricts it
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: parameters of a function that gives none: an object without properties
NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_call(name: str, arguments: str) -> dict:
    """One entry of a message's `tool_calls`."""
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _moved_refs(schema, to: str):
    """`schema` with each local `$ref` ("#...") made relative to the JSON pointer `to` (where it is moved)."""
    if isinstance(schema, dict):
        return {k: (to + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _moved_refs(v, to))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_moved_refs(v, to) for v in schema]
    return schema


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

    def reader(self) -> CallsReader | None:
        """A reader of one answer's calls ("required": its array; "auto": the parser's format; with the tools'
        names), or None: the answer is not read for calls ("function", "none")."""
        if self.choice not in ("required", "auto"):
            return None
        fmt = FORMATS[self.parser if self.choice == "auto" else "required"]
        return CallsReader(fmt, self.parallel, [t["name"] for t in self.tools])

    def _read(self, text: str) -> tuple[str | None, list[tuple[str, str]], CallsReader | None]:
        """(content, calls, the reader that read them or None) of a whole answer (`calls`)."""
        if self.choice == "function":
            return None, [(self.name, text)], None
        reader = self.reader()
        if reader is None:
            return text, [], None
        reader.feed(text, final=True)
        return *reader.answer(), reader

    def calls(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, [(name, arguments JSON text), ...]) of a whole answer (for "required" and "auto", `reader`'s:
        the reading a stream makes)."""
        return self._read(text)[:2]

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """A choice's `message` and `finish_reason` for its answer `text` (finished for `finish`;
        `tool_stream.finish_reason`)."""
        content, calls, reader = self._read(text)
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [tool_call(n, a) for n, a in calls]
        return msg, finish_reason(reader, finish)

    def stream(self) -> ToolStream:
        """The state that turns one streamed choice's text deltas into chat deltas."""
        return ToolStream(self)
