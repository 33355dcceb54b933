"""OpenAI's Responses API on the server: `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`, `GET
/v1/responses/{id}/input_items` (the endpoints trtllm-serve and vLLM serve beside Chat Completions; OpenAI API
reference, "Responses").

A request is read as the chat request it amounts to (`ResponsesRequest.chat_request`): `instructions` becomes the
first (system) message, `input` (a string: one user message; or a list of items) the messages after it, a function
tool `{"type": "function", "name", "parameters"}` the chat tool `{"type": "function", "function": {...}}`,
`text.format` the `response_format`, `max_output_tokens` `max_completion_tokens`; the chat pipeline answers it
(DFlash, guided decoding, tool calling, the reasoning parser: as on /v1/chat/completions, so the same tokens), and
the answer is written as a Response (`whole_response`): a `reasoning` item (with `--reasoning-parser`), a `message`
item with one `output_text` part, and a `function_call` item per tool call, in the order the answer writes them
(reasoning first, unless qwen3's answer writes text before `<think>`: that text is a message item before it); the
last item is "incomplete" when the answer was cut, or when it is a function call that went wrong (its arguments
not valid JSON, where chat's finish_reason is not "tool_calls"), the others "completed". Streamed
(`stream: true`), the server-sent events are named (`event: response.output_text.delta`) and numbered
(`sequence_number`) as OpenAI sends them (`ResponseEvents`): `response.created`, `response.in_progress`, per item
`response.output_item.added` ... `response.output_item.done` with its text or arguments as deltas, then
`response.completed` (or `response.incomplete` when `max_output_tokens` cut the answer, its `incomplete_details`
saying so, or when its last item is a function call that went wrong, `incomplete_details.reason` null: none of
OpenAI's reasons is why (trtllm-serve and vLLM say "completed" there, which tells a client the call is usable); `response.failed` when the server's shutdown cut it, its `error` saying so) carrying the
whole Response, equal to the one a non-streamed request gets.

Conversation state: a response is stored (`store`, default true) in the server's memory (`ResponseStore`, the
`MAX_STORED` most recent), retrievable by `GET /v1/responses/{id}` (in progress while it is made; cancelled when its
client left first, failed when its generation failed), its input by `GET /v1/responses/{id}/input_items`
(OpenAI's pages: limit, order, after), deletable, and continued by a later request's
`previous_response_id` (its input and output come before the new input; its `instructions` do not carry over, as
OpenAI's). Input items: messages (roles user, system, developer (read as system), assistant; text parts
`input_text` / `output_text`), `function_call` and `function_call_output` items (a tool call and its result, as
chat's assistant `tool_calls` and `tool` messages), `reasoning` items (dropped: chat templates drop earlier turns'
reasoning). Log-probabilities: `include: ["message.output_text.logprobs"]` (with `top_logprobs` alternatives) gives
each `output_text` part its tokens' logprobs, for plain text answers.

Not served, each refused with a 400 naming the field: built-in tools (web search, file search, MCP...) and
`tool_choice` "allowed_tools", image / file / audio inputs (the target reads text), `background`, `truncation:
"auto"`, `conversation`, `prompt` templates, `max_tool_calls`. Accepted and echoed without effect: `reasoning`
(`effort`: the target thinks as its chat template makes it; Qwen3's switch is `chat_template_kwargs`), `metadata`,
`user`, `service_tier`, `prompt_cache_key`, `safety_identifier`, `text.verbosity`, `include:
["reasoning.encrypted_content"]` (reasoning items carry their text in the clear). The fields are typed as OpenAI
types them: a value of another type, outside an enum (`truncation`, `service_tier`, `tool_choice`'s strings,
`include`), or an unknown field is a 400 with OpenAI's `code` ("invalid_type", "invalid_value", "unknown_parameter":
`dflash_trt.serve.app.responses_error_code`), before any "not served" refusal. `usage.output_tokens_details.
reasoning_tokens` counts the output tokens of the reasoning (`--reasoning-parser`; 0 without one).
"""

from __future__ import annotations

import json
import re
import uuid
from collections import OrderedDict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from dflash_trt.errors import ConfigError, DFlashError, InvalidRequestError, PromptTooLongError
from dflash_trt.serve.protocol import ChatCompletionRequest, refuse_unless_off
from dflash_trt.serve.tools import unknown_field

#: responses kept for GET and previous_response_id (the oldest are dropped first), and the bytes of JSON they may
#: hold in all (their outputs, echoed fields and conversations)
MAX_STORED = 1024
MAX_STORED_BYTES = 256 * 2**20
#: OpenAI's limits on `metadata`: pairs, characters of a key, of a value
METADATA_LIMITS = (16, 64, 512)
#: the longest `user` taken (characters; it is echoed and stored)
MAX_USER = 512
#: a json_schema format's name, as OpenAI restricts it
_FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: `include` values served: logprobs on output text; encrypted reasoning (accepted: reasoning comes in the clear)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")
#: every `include` value OpenAI takes (the openai client's `ResponseIncludable`): one outside them is an invalid value,
#: one of the others is refused as not served
OPENAI_INCLUDES = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                   "message.input_image.image_url", "computer_call_output.output.image_url",
                   "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs")
#: tool_choice's string values
TOOL_CHOICES = ("none", "auto", "required")
#: chat request field -> the Responses field it came from (an error about one names the other)
FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
               "response_format": "text.format", "messages": "input"}


#: field -> the values that mean "off" (accepted); anything else is refused (`ResponsesRequest.unsupported`)
UNSUPPORTED = {"truncation": (None, "disabled"), "background": (None, False), "conversation": (None,),
               "prompt": (None,), "max_tool_calls": (None,)}
HINTS = {"truncation": "a conversation must fit the target's context; shorten it, or start a new one",
         "background": "send the request and wait for its answer, or stream it",
         "conversation": "chain responses with previous_response_id", "prompt": "send the prompt's text as "
         "instructions and input", "max_tool_calls": "parallel_tool_calls: false allows one call"}


class ResponseNotFound(DFlashError):
    """A response id this server does not hold (never made, not stored, deleted, or dropped as the oldest): 404."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def new_id(prefix: str) -> str:
    """An item id: `prefix` ("resp", "msg", "rs", "fc") and 48 hex digits, as OpenAI's ids look."""
    return f"{prefix}_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}"


class Reasoning(BaseModel):
    """`reasoning` (OpenAI's `Reasoning`): checked and echoed; the target thinks as its chat template makes it."""

    model_config = ConfigDict(extra="forbid")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None


class TextConfig(BaseModel):
    """`text`: its `format` (`response_format`) and `verbosity` (echoed)."""

    model_config = ConfigDict(extra="forbid")
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(BaseModel):
    """`stream_options` (OpenAI's `ResponseCreateParams.StreamOptions`): `include_obfuscation` is accepted and has no
    effect (events carry no obfuscation padding)."""

    model_config = ConfigDict(extra="forbid")
    include_obfuscation: StrictBool | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses: OpenAI's fields (types checked strictly, unknown fields refused, as on the other
    endpoints), plus the sampling extensions vLLM's Responses endpoint takes (`top_k`, `seed`) and
    `chat_template_kwargs`. Ranges are checked where the chat request checks them (`chat_request`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, strict=True)
    temperature: float | None = Field(default=None, strict=True)
    top_p: float | None = Field(default=None, strict=True)
    top_k: int | None = Field(default=None, strict=True)
    seed: int | None = Field(default=None, strict=True)
    stream: StrictBool | None = False  # null: false (the openai client types it Optional)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    store: StrictBool | None = True  # null: true (OpenAI's default)
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, strict=True)
    chat_template_kwargs: dict[str, Any] | None = None
    # echoed, no effect on the answer
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    stream_options: StreamOptions | None = None
    # refused unless left at their "off" value (`unsupported`); typed as OpenAI's, so a value of another type or
    # outside the enum is the 400 OpenAI gives (invalid_type / invalid_value), not "not supported"
    truncation: Literal["auto", "disabled"] | None = None
    background: StrictBool | None = None
    conversation: StrictStr | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(default=None, strict=True)

    def unsupported(self) -> None:
        """Raises InvalidRequestError naming the first field asking for what this server does not do."""
        if isinstance(self.tool_choice, str) and self.tool_choice not in TOOL_CHOICES:
            raise InvalidRequestError(f"Invalid value: {self.tool_choice!r:.60}. Supported values are: 'none', 'auto' "
                                      "and 'required' (or {\"type\": \"function\", \"name\": ...})",
                                      param="tool_choice", code="invalid_value")
        bad = next((x for x in self.include or () if x not in OPENAI_INCLUDES), None)
        if bad is not None:
            raise InvalidRequestError(f"Invalid value: {bad!r:.60}. Supported values of include are: "
                                      f"{', '.join(map(repr, OPENAI_INCLUDES))}", param="include", code="invalid_value")
        refuse_unless_off(self, UNSUPPORTED, HINTS)
        bad = next((x for x in self.include or () if x not in INCLUDES), None)
        if bad is not None:
            raise InvalidRequestError(f"include holds {bad!r:.60}, which this server does not return; it serves "
                                      f"{', '.join(INCLUDES)}", param="include")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true", param="stream_options")
        pairs, key_len, value_len = METADATA_LIMITS
        meta = self.metadata or {}
        if len(meta) > pairs or any(len(k) > key_len or len(v) > value_len for k, v in meta.items()):
            raise InvalidRequestError(f"metadata holds at most {pairs} pairs, keys of at most {key_len} characters and "
                                      f"values of at most {value_len} (OpenAI's limits)", param="metadata")
        if self.user is not None and len(self.user) > MAX_USER:
            raise InvalidRequestError(f"user is {len(self.user)} characters; give at most {MAX_USER}", param="user")
        if self.previous_response_id == "":
            raise InvalidRequestError("previous_response_id is empty; give a response's id (resp_...), or leave it out",
                                      param="previous_response_id")
        from dflash_trt.api import check_text

        for name in ("instructions", "metadata", "user", "text", "tool_choice", "tools", "previous_response_id"):
            try:  # echoed in the Response: text the JSON answer could not encode is the request's fault
                check_text(json.dumps(getattr(self, name) if name != "text" or self.text is None else
                                      self.text.model_dump(exclude_none=True), ensure_ascii=False), name)
            except InvalidRequestError as exc:
                raise InvalidRequestError(str(exc), param=name) from None

    def logprobs(self) -> bool:
        """Whether output text carries logprobs: `include` names them, or `top_logprobs` asks for alternatives."""
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)

    def chat_request(self, history: list[dict]):
        """(the `ChatCompletionRequest` this request amounts to, its conversation): the
        chat request's messages are the instructions (a system message), `history` (a previous response's
        conversation, chat messages) and the input's (`input_messages`); the conversation is the same without
        the instructions (what a later `previous_response_id` continues).

        Raises:
            InvalidRequestError: an input item, tool, tool_choice or text.format this server does not serve (param:
                the Responses field).
        """
        conversation = history + input_messages(self.input)
        check_tool_results(conversation)
        if not any(m["role"] == "user" and _has_text(m["content"]) for m in conversation):
            raise InvalidRequestError('input has no user message with text; give one, e.g. "input": "Hi" or [{"role": '
                                      '"user", "content": "Hi"}]', param="input")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise InvalidRequestError(f"tool_choice {json.dumps(self.tool_choice)[:60]} needs tools; give tools, or "
                                      "leave tool_choice out", param="tool_choice")
        fmt = response_format(self.text)
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, dict)
        if forced and fmt is not None and self.tools:
            raise InvalidRequestError(f"tool_choice {json.dumps(self.tool_choice)[:60]} fixes the answer's format (a "
                                      "function call), so it cannot have a text.format too; leave one of them out",
                                      param="tool_choice")
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        body = {"messages": system + conversation, "stream": bool(self.stream),
                "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed, "tools": chat_tools(self.tools),
                "tool_choice": chat_tool_choice(self.tool_choice), "parallel_tool_calls": self.parallel_tool_calls,
                "response_format": fmt, "chat_template_kwargs": self.chat_template_kwargs}
        if self.logprobs():
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        try:
            return ChatCompletionRequest(**{k: v for k, v in body.items() if v is not None}), conversation
        except ValidationError as exc:  # the fields are typed here already: a value chat reads otherwise
            raise InvalidRequestError(f"invalid request: {exc.errors()[0].get('msg')}") from None


def _text(content, where: str, role: str) -> str | list:
    """A message's content as chat takes it: a string, or its text parts (`input_text`, `output_text`, `text`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} ({role}) has content {json.dumps(content)[:40]}; give a string or a list of "
                                  '{"type": "input_text", "text": "..."} parts', param="input")
    if not content:
        raise InvalidRequestError(f"{where} ({role}) has no content parts; give its text as a string or as "
                                  '{"type": "input_text", "text": "..."} parts', param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("input_image", "input_file", "input_audio"):
            raise InvalidRequestError(f"{where} part {j} is {kind}; this server's target reads text only: give "
                                      "input_text parts", param="input")
        else:
            raise InvalidRequestError(f'{where} part {j} is not a {{"type": "input_text", "text": "..."}} part (got '
                                      f"{json.dumps(part)[:60]})", param="input")
    return parts


def _has_text(content) -> bool:
    """Whether a chat message's content (a string, text parts, or None) holds non-blank text."""
    if isinstance(content, list):
        return any(p["text"].strip() for p in content)
    return bool(content and content.strip())


def input_messages(items: str | list) -> list[dict]:
    """`input` as chat messages: a string is one user message; a list's items become messages in order
    (message items; `function_call` items as an assistant message's `tool_calls`, consecutive ones joined;
    `function_call_output` items as `tool` messages; `reasoning` items dropped).

    Raises:
        InvalidRequestError (param "input"): an item that is not an object, of a type or role not served, or
            missing a field its type needs.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f'{where} is {json.dumps(item)[:40]}, not an item; give {{"role": "user", '
                                      '"content": "..."} messages (or a string input)', param="input")
        kind = item.get("type", "message")

        def field(name: str, item=item, where=where, kind=kind, empty: bool = False) -> str:
            value = item.get(name)
            if not isinstance(value, str) or (not value and not empty):
                raise InvalidRequestError(f"{where} ({kind}) needs {name!r} as a {'' if empty else 'non-empty '}string",
                                          param="input")
            return value

        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequestError(f"{where} has role {role!r:.40}; the roles are user, system, developer, "
                                          "assistant (tool results are function_call_output items)", param="input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), where, role)})
        elif kind == "function_call":
            call = {"id": field("call_id"), "type": "function",
                    "function": {"name": field("name"), "arguments": field("arguments", empty=True)}}
            if out and out[-1]["role"] == "assistant":  # the same turn: the calls follow its text
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": field("call_id"),
                        "content": _text(item.get("output"), where, "function_call_output")})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequestError(f"{where} is an item of type {kind!r:.40}, which this server does not serve; "
                                      "give message, function_call, function_call_output or reasoning items",
                                      param="input")
    return out


_STATUSES = ("in_progress", "completed", "incomplete")


def listed_items(items: str | list) -> list[dict]:
    """`input` as `GET /v1/responses/{id}/input_items` lists it (and as it is stored): each item with its `type`, an
    `id` (the one given, or a new one), a `status` (the one given, or "completed"), and its own fields only: a
    message's `role` and content as parts (`input_text`, or `output_text` for the assistant's, as OpenAI lists them);
    a function call's `call_id`, `name`, `arguments`; a function call output's `call_id`, `output`; a reasoning item's
    `summary`, `content`, `encrypted_content`.

    Raises:
        InvalidRequestError (param "input"): an item `input_messages` refuses; an id that is not a string, or used
            twice; a status OpenAI does not have; a reasoning item's summary or content not as OpenAI writes them;
            text a tokenizer refuses (a lone surrogate) in any of them.
    """
    from dflash_trt.api import check_text

    input_messages(items)  # the item types, roles and text parts
    out, seen = [], set()
    for i, item in enumerate([{"role": "user", "content": items}] if isinstance(items, str) else items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        item_id, status = item.get("id"), item.get("status", "completed")
        if item_id is not None and (not isinstance(item_id, str) or not item_id):
            raise InvalidRequestError(f"{where} has an id that is not a string: {json.dumps(item_id)[:40]}",
                                      param="input")
        if item_id is not None and item_id in seen:
            raise InvalidRequestError(f"{where} has the id {json.dumps(item_id)[:80]}, which an earlier item has; give "
                                      "each item its own (or none)", param="input")
        seen.add(item_id)
        if kind != "reasoning" and status not in _STATUSES:
            raise InvalidRequestError(f"{where} has status {json.dumps(status)[:40]}; give one of "
                                      f"{', '.join(_STATUSES)} (or none)", param="input")
        if kind == "message":
            role, content = item["role"], item["content"]
            texts = [content] if isinstance(content, str) else [p["text"] for p in content]
            parts = ([{"type": "output_text", "text": t, "annotations": []} for t in texts] if role == "assistant"
                     else [{"type": "input_text", "text": t} for t in texts])
            listed = {"type": "message", "role": role, "content": parts}
        elif kind == "function_call":
            listed = {k: item[k] for k in ("type", "call_id", "name", "arguments")}
        elif kind == "function_call_output":
            output = item["output"]
            listed = {"type": kind, "call_id": item["call_id"], "output": output if isinstance(output, str) else
                      [{"type": "input_text", "text": p["text"]} for p in output]}
        else:
            listed = {"type": "reasoning", "summary": _reasoning_parts(item.get("summary", []), "summary_text", where)}
            if item.get("content") is not None:
                listed["content"] = _reasoning_parts(item["content"], "reasoning_text", where)
            if item.get("encrypted_content") is not None:
                if not isinstance(item["encrypted_content"], str):
                    raise InvalidRequestError(f"{where} has encrypted_content that is not a string", param="input")
                listed["encrypted_content"] = item["encrypted_content"]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "rs")
        out.append({"id": item_id or new_id(prefix), **listed, **({} if kind == "reasoning" else {"status": status})})
    try:
        check_text(json.dumps(out, ensure_ascii=False), "input")
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), param="input") from None
    return out


def _reasoning_parts(parts, kind: str, where: str) -> list[dict]:
    """A reasoning item's `summary` ("summary_text") or `content` ("reasoning_text") parts, checked."""
    if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == kind and
                                              isinstance(p.get("text"), str) for p in parts):
        field = "summary" if kind == "summary_text" else "content"
        raise InvalidRequestError(f'{where} (reasoning) has a {field} that is not a list of {{"type": "{kind}", '
                                  '"text": "..."} parts', param="input")
    return [{"type": kind, "text": p["text"]} for p in parts]


def check_tool_results(conversation: list[dict]) -> None:
    """Raises InvalidRequestError (param "input") when a tool result (`function_call_output`) answers no earlier
    call of the conversation, a call has no result, or two calls share a call_id (OpenAI's rules: each result names
    its call, each call gets its result before the conversation goes on)."""
    calls: dict[str, None] = {}  # in order
    answered: set[str] = set()
    for m in conversation:
        for call in m.get("tool_calls") or ():
            if call["id"] in calls:
                raise InvalidRequestError(f"two function calls have the call_id {json.dumps(call['id'])[:80]}; give "
                                          "each call its own", param="input")
            calls[call["id"]] = None
        if m["role"] == "tool" and m["tool_call_id"] not in calls:
            raise InvalidRequestError(f"no function call found for the function_call_output with call_id "
                                      f"{json.dumps(m['tool_call_id'])[:80]}; give the function_call item before "
                                      "its output (or continue the response that made it: previous_response_id)",
                                      param="input")
        if m["role"] == "tool":
            answered.add(m["tool_call_id"])
    missing = next((c for c in calls if c not in answered), None)
    if missing is not None:
        raise InvalidRequestError(f"no function_call_output found for the function call with call_id "
                                  f"{json.dumps(missing)[:80]}; give its output in input ({{\"type\": "
                                  '"function_call_output", "call_id": ..., "output": "..."})', param="input")


#: the fields of a Responses function tool (OpenAI's; another is refused, naming it)
RESPONSES_TOOL_FIELDS = ("type", "name", "description", "parameters", "strict")


def chat_tools(tools: list | None) -> list[dict] | None:
    """Responses' function tools (`{"type": "function", "name", "description", "parameters", "strict"}`) as chat's
    (`{"type": "function", "function": {...}}`; their names and schemas are checked there).

    Raises:
        InvalidRequestError (param "tools"): a tool of another type (a built-in tool), a field a function tool does
            not have (`RESPONSES_TOOL_FIELDS`).
    """
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise InvalidRequestError(f"tools[{i}] is of type {kind!r:.40}; this server serves function tools "
                                      '({"type": "function", "name": ..., "parameters": {...}}), not built-in ones',
                                      param="tools")
        if "function" in t and "name" not in t:
            raise InvalidRequestError(f'tools[{i}] is in chat\'s form ({{"type": "function", "function": {{...}}}}); '
                                      'a Responses function tool has its fields at the top: {"type": "function", '
                                      '"name": ..., "parameters": {...}}', param="tools")
        unknown = unknown_field(t, RESPONSES_TOOL_FIELDS)
        if unknown:  # named here, in Responses' form (chat's check would call it a field of the function)
            raise InvalidRequestError(f"tools[{i}] has the {unknown}", param="tools")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out


def chat_tool_choice(choice):
    """Responses' `tool_choice` as chat's: "none" / "auto" / "required" as they are, `{"type": "function", "name"}`
    as `{"type": "function", "function": {"name"}}`.

    Raises:
        InvalidRequestError (param "tool_choice"): another form (allowed_tools, a built-in tool type).
    """
    if choice is None or isinstance(choice, str):
        return choice
    if (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str)
            and set(choice) == {"type", "name"}):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}, '
                              f"got {choice!r:.80}", param="tool_choice")


def response_format(text: TextConfig | None) -> dict | None:
    """`text.format` as chat's `response_format`: {"type": "text"} (or none): None; {"type": "json_object"};
    {"type": "json_schema", "name", "schema", "strict", "description"}: chat's `{"type": "json_schema",
    "json_schema": {...}}`.

    Raises:
        InvalidRequestError (param "text.format"): another type, a json_schema format without its schema or name, a
            field of the wrong type.
    """
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return {"type": "json_object"}
    if kind == "json_schema":
        def bad(problem: str):
            return InvalidRequestError(f'text.format of type "json_schema" {problem}; give {{"type": "json_schema", '
                                       '"name": ..., "schema": {...}} (and "strict", "description")',
                                       param="text.format")

        if not isinstance(fmt.get("schema"), dict):
            raise bad('needs "schema" (an object)')
        if not isinstance(fmt.get("name"), str) or not _FORMAT_NAME.fullmatch(fmt["name"]):
            raise bad('needs "name": 1 to 64 of a-z, A-Z, 0-9, _ and -')
        if not isinstance(fmt.get("strict", False), (bool, type(None))) or not isinstance(
                fmt.get("description", ""), (str, type(None))):
            raise bad('has "strict" that is not a boolean or "description" that is not a string')
        extra = set(fmt) - {"type", "name", "schema", "strict", "description"}
        if extra:
            raise bad(f"has {sorted(extra)!r:.60}, which it does not take")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise InvalidRequestError(f'text.format must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": '
                              f'"json_schema", "name": ..., "schema": {{...}}}}, got {json.dumps(fmt)[:80]}',
                              param="text.format")


def as_responses_error(exc: DFlashError) -> DFlashError:
    """An error the chat pipeline raised, about the Responses fields the chat fields came from (`FIELD_NAMES`):
    its `param` and the field names in its message."""
    param = getattr(exc, "param", None)
    message = str(exc)
    if param != "chat_template_kwargs":  # whose message names the template's own variables
        # field names, not the same words quoted (a tool's name, a value)
        message = re.sub(r"(?<!['\"])\b(" + "|".join(FIELD_NAMES) + r")\b(?!['\"])",
                         lambda m: FIELD_NAMES[m.group(1)], message)
    if isinstance(exc, PromptTooLongError):
        return PromptTooLongError(message, param=FIELD_NAMES.get(param, param))
    if isinstance(exc, InvalidRequestError):
        return InvalidRequestError(message, param=FIELD_NAMES.get(param, param))
    if isinstance(exc, ConfigError):  # the messages: one the chat template refused
        return InvalidRequestError(message, param="input")
    return exc


def _output_text(text: str, logprobs: list | None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def message_item(text: str, status: str, logprobs: list | None = None, item_id: str | None = None) -> dict:
    """An output `message` item: the assistant's text as one `output_text` part."""
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [_output_text(text, logprobs)]}


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict:
    """An output `reasoning` item: the reasoning text as one `reasoning_text` part (no summary)."""
    return {"type": "reasoning", "id": item_id or new_id("rs"), "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(call: dict, status: str, item_id: str | None = None) -> dict:
    """An output `function_call` item from a chat tool call ({"id", "function": {"name", "arguments"}})."""
    return {"type": "function_call", "id": item_id or new_id("fc"), "status": status, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def assistant_messages(items: list[dict]) -> list[dict]:
    """The chat messages a response's output items stand for in a later turn's conversation: one assistant
    message with its text and tool calls (reasoning dropped, as chat templates drop it), or none."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    if not text and not calls:
        return []
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def status_of(finish_reason: str, broken_call: bool = False) -> tuple[str, dict | None]:
    """A Response's (status, incomplete_details) for its answer's finish_reason: "incomplete" with reason
    "max_output_tokens" (finish_reason "length"), "failed" (aborted by the server's shutdown: `ABORTED`), "incomplete"
    with reason null when the answer ended at a function call that went wrong (`broken_call`: its arguments not valid
    JSON, the model having stopped inside them or written broken JSON; its item is "incomplete", and a Response that
    holds an incomplete item is not "completed"; none of OpenAI's reasons, `max_output_tokens`, `max_messages`,
    `content_filter`, `steered`, is why, and a reason outside them would break clients that read it as their enum),
    else "completed" (OpenAI API reference, "The response object": `status`, `incomplete_details.reason`)."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "failed", None
    return ("incomplete", {"reason": None}) if broken_call else ("completed", None)


#: the `error` of a Response whose generation the server's shutdown aborted
ABORTED = {"code": "server_error", "message": "generation aborted: the server is shutting down; send the request again"}


def response_object(rid: str, created_at: int, model: str, req: ResponsesRequest, output: list[dict], status: str,
                    usage: dict | None, metrics: dict | None = None) -> dict:
    """A Response object (OpenAI's `Response`): the request's settings echoed, `output`, `usage`
    ({"input_tokens", "output_tokens", "total_tokens", and their details}), and the runtime's `metrics` (acceptance
    length tau... of the answer, non-standard, as a chat choice's)."""
    out = {"id": rid, "object": "response", "created_at": created_at, "status": status, "background": False,
           "error": ABORTED if status == "failed" else None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
           "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
           "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
           "previous_response_id": req.previous_response_id,
           "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None, "store": req.store is not False,
           "temperature": 1.0 if req.temperature is None else req.temperature,
           "text": {"format": {"type": "text"}, **(req.text.model_dump(exclude_none=True) if req.text is not None else {})},
           "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
           "top_logprobs": req.top_logprobs, "top_p": 1.0 if req.top_p is None else req.top_p,
           "truncation": "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {},
           # (the tier that served it, as OpenAI's: "default" for "auto"; no tier changes anything here)
           "service_tier": "default" if req.service_tier in (None, "auto") else req.service_tier,
           "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier}
    if metrics is not None:
        out["metrics"] = metrics
    return out


def usage_of(input_tokens: int, output_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0) -> dict:
    """A Response's `usage`: `cached_tokens` input tokens reused from the prefix cache (`dflash-trt serve
    --enable-prefix-caching`; 0 without), cache_write_tokens 0 (nothing is billed), `reasoning_tokens` of the
    output tokens its reasoning (`dflash_trt.serve.reasoning.reasoning_token_count`; 0 without a reasoning
    parser)."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def tag_pieces(state, text: str) -> list[str]:
    """`text` as the chat stream `state` (`ChatStream`) is fed it: when it splits reasoning, cut after each ">" (the
    last character of every reasoning tag, `<think>` and `</think>`), so each piece completes at most one tag, at its
    end: each piece's delta holds one field (reasoning or content) and the Response's items follow the order the
    answer writes them in, however its text was cut into deltas (qwen3's text before `<think>` is a message item
    before the reasoning item); else whole (its delta and its logprobs stay one event)."""
    if state.reasoning is None:
        return [text]
    parts = text.split(">")
    return [p + ">" for p in parts[:-1]] + [parts[-1]]


class ResponseEvents:
    """The events of one response, from its answer's text through its chat stream (`dflash_trt.serve.chat.
    ChatStream`): `start`, then `text` per text delta, then `end` (or `delta` per chat delta and `finish`). Each
    event is a dict with its `type` and `sequence_number` (0, 1, ...). Its items are the answer's reasoning, text and
    function calls in the order the answer writes them (`tag_pieces`), so the Response of the last event is the same
    however the text was cut into deltas: a non-streamed request's (`whole_response`) too.

    Args:
        response: the Response as it starts (`response_object` with status "in_progress", no output, no usage).
    """

    def __init__(self, response: dict):
        self.response, self.items, self.seq = response, [], 0
        self.open: dict | None = None  # the item under way

    def _event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def _where(self) -> dict:
        return {"output_index": len(self.items) - 1, "item_id": self.open["id"]}

    def start(self) -> list[dict]:
        """`response.created`, `response.in_progress`."""
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def _add(self, item: dict) -> list[dict]:
        events = self._close()
        self.items.append(item)
        self.open = item
        events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=_copy(item)))
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                      part=_copy(part)))
        return events

    def _text(self, kind: str, text: str, logprobs: list | None = None) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._add(message_item("", "in_progress", [] if logprobs is not None else None)
                                if kind == "message" else reasoning_item("", "in_progress"))
        part = self.open["content"][0]
        part["text"] += text
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text))
        else:
            if logprobs is not None:
                part.setdefault("logprobs", []).extend(logprobs)
            events.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                      logprobs=logprobs or []))
        return events

    def delta(self, delta: dict, logprobs: list | None = None) -> list[dict]:
        """The events of one chat delta ({"reasoning_content", "content", "tool_calls"}; its role is ignored);
        `logprobs`: its tokens' (chat's `logprobs.content` entries), or None."""
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content") or logprobs:
            events += self._text("message", delta.get("content") or "", logprobs)
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):  # a new call
                events += self._add(function_call_item({"id": call["id"], "function": {
                    "name": fn.get("name", ""), "arguments": ""}}, "in_progress"))
            if fn.get("arguments"):
                self.open["arguments"] += fn["arguments"]
                events.append(self._event("response.function_call_arguments.delta", **self._where(),
                                          delta=fn["arguments"]))
        return events

    def text(self, state, text: str, logprobs: list | None = None) -> list[dict]:
        """The events of the answer's next `text` (its tokens' `logprobs`, or None), read by the chat stream `state`
        (`ChatStream.delta`) in `tag_pieces`."""
        pieces = tag_pieces(state, text)
        events = []
        for i, piece in enumerate(pieces, 1):
            events += self.delta(state.delta(piece) if piece else {}, logprobs if i == len(pieces) else None)
        return events

    def end(self, state, text: str, finish_reason: str, usage: dict, metrics: dict | None = None,
            logprobs: list | None = None) -> list[dict]:
        """The last events: the answer's last `text` (the rest the chat stream `state` held back: `ChatStream.last`)
        and `finish`, with the answer's `finish_reason` (the stream's may differ: tool calls) and whether its last
        call went wrong (`ChatStream.broken_call`)."""
        *head, tail = tag_pieces(state, text)
        events = []
        for piece in head:
            events += self.delta(state.delta(piece))
        delta, finish = state.last(tail, finish_reason)
        return events + self.delta(delta, logprobs) + self.finish(finish, usage, metrics, state.broken_call)

    def _close(self, status: str = "completed") -> list[dict]:
        item, events = self.open, []
        if item is None:
            return events
        where = self._where()
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                events.append(self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                          logprobs=part.get("logprobs") or []))
            else:
                events.append(self._event("response.reasoning_text.done", **where, content_index=0,
                                          text=part["text"]))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=_copy(part)))
        item["status"] = status
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=_copy(item)))
        self.open = None
        return events

    def finish(self, finish_reason: str, usage: dict, metrics: dict | None = None,
               broken_call: bool = False) -> list[dict]:
        """The last events: the open item's end (an empty message first when nothing came), then
        `response.completed` (`response.incomplete` when max_output_tokens cut the answer or, `broken_call`, the open
        item is a function call that went wrong: its arguments not valid JSON, the model having stopped inside them
        or broken their JSON; `response.failed` when the server's shutdown cut it: its `error` says so) with the
        whole Response (`status_of`). The open item is "incomplete" unless the Response is "completed"."""
        events = [] if self.items else self._add(message_item("", "in_progress"))
        status, details = status_of(finish_reason, broken_call)
        events += self._close("completed" if status == "completed" else "incomplete")
        final = {**self.response, "status": status, "output": self.items, "usage": usage,
                 "error": ABORTED if status == "failed" else None, "incomplete_details": details}
        if metrics is not None:
            final["metrics"] = metrics
        self.response = final
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        events.append(self._event(kind, response=final))
        return events

    def error(self, body: dict) -> dict:
        """The `error` event of a generation that failed (OpenAI's error object's fields)."""
        err = body["error"]
        return self._event("error", code=err.get("code") or err.get("type"), message=err["message"],
                           param=err.get("param"))


def whole_response(start: dict, state, text: str, finish_reason: str, usage: dict, metrics: dict | None = None,
                   logprobs: list | None = None) -> dict:
    """The Response of a whole answer (a non-streamed request's): the one its stream ends with (`ResponseEvents`), from
    `start` (`response_object` in progress), the chat stream `state` (`ChatStream`) and the answer's `text`,
    `finish_reason`, `usage`, `metrics` and `logprobs` (chat's `logprobs.content` entries, or None)."""
    out = ResponseEvents(start)
    out.delta(state.opening() or {})
    out.end(state, text, finish_reason, usage, metrics, logprobs)
    return out.response


def _copy(obj):
    """A deep copy of JSON data (an event's item must not change when the item grows later)."""
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


class ResponseStore:
    """Stored responses (`store: true`) in memory: id -> (the Response, the chat conversation it ends, or None while
    it cannot be continued: in progress, failed, cancelled; its input items, `listed_items`), the `limit` most recent
    within `max_bytes` of JSON (the oldest dropped first). Used from the event loop only."""

    def __init__(self, limit: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.limit, self.max_bytes, self.bytes = limit, max_bytes, 0
        self._items: OrderedDict[str, tuple[dict, list[dict] | None, list[dict], int]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict] | None, items: list[dict]) -> None:
        """Keep (or replace) `response`, `conversation` (its input's chat messages and its output's, instructions
        left out; None: not to be continued) and its input `items`."""
        size = len(json.dumps([response, conversation, items], ensure_ascii=False))
        self._drop(response["id"])
        self._items[response["id"]] = (response, conversation, items, size)
        self.bytes += size
        while self._items and (len(self._items) > self.limit or self.bytes > self.max_bytes):
            self._drop(next(iter(self._items)))

    def __contains__(self, rid: str) -> bool:
        return rid in self._items

    def _drop(self, rid: str) -> None:
        if rid in self._items:
            self.bytes -= self._items.pop(rid)[3]

    def get(self, rid: str, param: str | None = None) -> tuple[dict, list[dict] | None, list[dict]]:
        """(Response, conversation or None, input items) of `rid`.

        Raises:
            ResponseNotFound: no such stored response (`param`: the field that named it).
        """
        if rid not in self._items:
            raise ResponseNotFound(f"no stored response has id {json.dumps(rid)[:80]} (never made, made with store: "
                                   f"false, deleted, or dropped: this server keeps the {self.limit} most recent, in "
                                   "memory, until it stops)", param=param)
        return self._items[rid][:3]

    def conversation(self, rid: str) -> list[dict]:
        """The conversation a new request continues with `previous_response_id` `rid`.

        Raises:
            ResponseNotFound: no such stored response.
            InvalidRequestError: it has not finished (in progress), or failed or was cancelled.
        """
        response, conversation, _ = self.get(rid, "previous_response_id")
        if conversation is None:
            raise InvalidRequestError(f"the response {rid} is {response['status']}; continue a completed (or "
                                      "incomplete) response", param="previous_response_id")
        return conversation

    def input_items(self, rid: str, limit: int = 20, order: str = "desc", after: str | None = None) -> dict:
        """A page of `rid`'s input items, OpenAI's list object ({"object": "list", "data", "first_id", "last_id",
        "has_more"}): `limit` (1 to 100) items in `order` ("asc" or "desc", the default), after the item `after`.

        Raises:
            ResponseNotFound: no such stored response.
            InvalidRequestError: limit, order or after out of range (naming it).
        """
        items = list(self.get(rid)[2])
        if not 1 <= limit <= 100:
            raise InvalidRequestError(f"limit must be in [1, 100], got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise InvalidRequestError(f'order must be "asc" or "desc", got {order!r:.40}', param="order")
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise InvalidRequestError(f"after names no input item of {rid}: {after!r:.80}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        # an empty page's ids: "" (OpenAI's list type has them as strings)
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else "",
                "last_id": page[-1]["id"] if page else "", "has_more": len(items) > limit}

    def delete(self, rid: str) -> None:
        """Drop `rid` (ResponseNotFound when it is not stored)."""
        self.get(rid)
        self._drop(rid)
