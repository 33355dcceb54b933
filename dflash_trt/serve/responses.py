"""OpenAI's Responses API on the server: `POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`
(the endpoints trtllm-serve and vLLM serve beside Chat Completions; OpenAI API reference, "Responses").

A request is read as the chat request it amounts to (`ResponsesRequest.chat_request`): `instructions` becomes the
first (system) message, `input` (a string: one user message; or a list of items) the messages after it, a function
tool `{"type": "function", "name", "parameters"}` the chat tool `{"type": "function", "function": {...}}`,
`text.format` the `response_format`, `max_output_tokens` `max_completion_tokens`; the chat pipeline answers it
(DFlash, guided decoding, tool calling, the reasoning parser: as on /v1/chat/completions, so the same tokens), and
the answer is written as a Response (`output_items`): a `reasoning` item (with `--reasoning-parser`), a `message`
item with one `output_text` part, and a `function_call` item per tool call, in that order. Streamed
(`stream: true`), the server-sent events are named (`event: response.output_text.delta`) and numbered
(`sequence_number`) as OpenAI sends them (`ResponseEvents`): `response.created`, `response.in_progress`, per item
`response.output_item.added` ... `response.output_item.done` with its text or arguments as deltas, then
`response.completed` (or `response.incomplete` when `max_output_tokens` cut the answer; its `incomplete_details`
say so) carrying the whole Response, equal to the one a non-streamed request gets.

Conversation state: a response is stored (`store`, default true) in the server's memory (`ResponseStore`, the
`MAX_STORED` most recent), retrievable by `GET /v1/responses/{id}`, deletable, and continued by a later request's
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
["reasoning.encrypted_content"]` (reasoning items carry their text in the clear). `usage.output_tokens_details.
reasoning_tokens` is 0 (the split into reasoning and content is in text, not in tokens).
"""

from __future__ import annotations

import re
import uuid
from collections import OrderedDict
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from dflash_trt.errors import DFlashError, InvalidRequestError, PromptTooLongError
from dflash_trt.serve.protocol import ChatCompletionRequest, refuse_unless_off

#: responses kept for GET and previous_response_id (the oldest are dropped first)
MAX_STORED = 1024
#: `include` values served: logprobs on output text; encrypted reasoning (accepted: reasoning comes in the clear)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")
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


class ResponsesRequest(BaseModel):
    """POST /v1/responses: OpenAI's fields (types checked strictly, unknown fields refused, as on the other
    endpoints), plus the sampling extensions vLLM's Responses endpoint takes (`top_k`, `seed`) and
    `chat_template_kwargs`. Ranges are checked where the chat request checks them (`chat_request`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: Union[str, list[Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, strict=True)
    temperature: float | None = Field(default=None, strict=True)
    top_p: float | None = Field(default=None, strict=True)
    top_k: int | None = Field(default=None, strict=True)
    seed: int | None = Field(default=None, strict=True)
    stream: StrictBool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    text: Any = None
    reasoning: Any = None
    store: StrictBool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, strict=True)
    chat_template_kwargs: dict[str, Any] | None = None
    # echoed, no effect on the answer
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    stream_options: Any = None
    # refused unless left at their "off" value (`unsupported`)
    truncation: Any = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None

    def unsupported(self) -> None:
        """Raises InvalidRequestError naming the first field asking for what this server does not do."""
        refuse_unless_off(self, UNSUPPORTED, HINTS)
        bad = next((x for x in self.include or () if x not in INCLUDES), None)
        if bad is not None:
            raise InvalidRequestError(f"include holds {bad!r:.60}, which this server does not return; it serves "
                                      f"{', '.join(INCLUDES)}", param="include")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true", param="stream_options")

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
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        body = {"messages": system + conversation, "stream": self.stream,
                "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed, "tools": chat_tools(self.tools),
                "tool_choice": chat_tool_choice(self.tool_choice), "parallel_tool_calls": self.parallel_tool_calls,
                "response_format": response_format(self.text), "chat_template_kwargs": self.chat_template_kwargs}
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
        raise InvalidRequestError(f"{where} ({role}) has content {str(content)[:40]!r}; give a string or a list of "
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
                                      f"{str(part)[:60]})", param="input")
    return parts


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
            raise InvalidRequestError(f'{where} is {str(item)[:40]!r}, not an item; give {{"role": "user", '
                                      '"content": "..."} messages (or a string input)', param="input")
        kind = item.get("type", "message")

        def field(name: str, item=item, where=where, kind=kind) -> str:
            value = item.get(name)
            if not isinstance(value, str):
                raise InvalidRequestError(f"{where} ({kind}) needs {name!r} as a string", param="input")
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
                    "function": {"name": field("name"), "arguments": field("arguments")}}
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


def chat_tools(tools: list | None) -> list[dict] | None:
    """Responses' function tools (`{"type": "function", "name", "description", "parameters", "strict"}`) as chat's
    (`{"type": "function", "function": {...}}`; their names and schemas are checked there).

    Raises:
        InvalidRequestError (param "tools"): a tool of another type (a built-in tool).
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
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}, '
                              f"got {choice!r:.80}", param="tool_choice")


def response_format(text) -> dict | None:
    """`text.format` as chat's `response_format`: {"type": "text"} (or none): None; {"type": "json_object"};
    {"type": "json_schema", "name", "schema", "strict"}: chat's `{"type": "json_schema", "json_schema": {...}}`.

    Raises:
        InvalidRequestError (param "text" / "text.format"): not an object, another type, or a json_schema format
            without its schema.
    """
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise InvalidRequestError(f'text must be an object with "format" (and "verbosity"), got {text!r:.80}',
                                  param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequestError('text.format of type "json_schema" needs "schema" (an object)',
                                      param="text.format")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise InvalidRequestError(f'text.format must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": '
                              f'"json_schema", "name": ..., "schema": {{...}}}}, got {fmt!r:.80}', param="text.format")


def as_responses_error(exc: DFlashError) -> DFlashError:
    """An error the chat pipeline raised, about the Responses fields the chat fields came from (`FIELD_NAMES`):
    its `param` and the field names in its message."""
    param = getattr(exc, "param", None)
    message = re.sub(r"\b(" + "|".join(FIELD_NAMES) + r")\b", lambda m: FIELD_NAMES[m.group(1)], str(exc))
    if isinstance(exc, (InvalidRequestError, PromptTooLongError)):
        return type(exc)(message, param=FIELD_NAMES.get(param, param))
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


def output_items(message: dict, finish_reason: str, logprobs: list | None = None) -> list[dict]:
    """A chat answer's `message` ({"content", "reasoning_content", "tool_calls"}, `ChatAnswers.message`) as Response
    output items: reasoning, then the message (when it has text, or when nothing else came), then the calls. The
    last item's status is "incomplete" when max_output_tokens cut it (`finish_reason` "length")."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"], "completed"))
    calls = message.get("tool_calls") or []
    content = message.get("content") or ""
    if content or logprobs or (not items and not calls):
        items.append(message_item(content, "completed", logprobs))
    items += [function_call_item(c, "completed") for c in calls]
    if finish_reason == "length":
        items[-1]["status"] = "incomplete"
    return items


def assistant_messages(items: list[dict]) -> list[dict]:
    """The chat messages a response's output items stand for in a later turn's conversation: one assistant
    message with its text and tool calls (reasoning dropped, as chat templates drop it), or none."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    if not text and not calls:
        return []
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def status_of(finish_reason: str) -> str:
    """A Response's status for its answer's finish_reason: "incomplete" (max_output_tokens), "cancelled" (aborted
    by the server's shutdown), else "completed"."""
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason, "completed")


def response_object(rid: str, created_at: int, model: str, req: ResponsesRequest, output: list[dict], status: str,
                    usage: dict | None, metrics: dict | None = None) -> dict:
    """A Response object (OpenAI's `Response`): the request's settings echoed, `output`, `usage`
    ({"input_tokens", "output_tokens", "total_tokens", and their details}), and the runtime's `metrics` (acceptance
    length tau... of the answer, non-standard, as a chat choice's)."""
    out = {"id": rid, "object": "response", "created_at": created_at, "status": status, "background": False,
           "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
           "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
           "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
           "previous_response_id": req.previous_response_id, "reasoning": req.reasoning, "store": req.store,
           "temperature": 1.0 if req.temperature is None else req.temperature,
           "text": req.text if req.text is not None else {"format": {"type": "text"}},
           "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
           "top_logprobs": req.top_logprobs, "top_p": 1.0 if req.top_p is None else req.top_p,
           "truncation": "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {}}
    if metrics is not None:
        out["metrics"] = metrics
    return out


def usage_of(input_tokens: int, output_tokens: int) -> dict:
    """A Response's `usage` (no prompt cache: cached_tokens and cache_write_tokens 0; reasoning tokens not counted apart: 0)."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


class ResponseEvents:
    """The streamed events of one response, from its chat deltas (`dflash_trt.serve.chat.ChatStream`): `start`,
    then `delta` per chat delta, then `finish`. Each event is a dict with its `type` and `sequence_number` (0, 1,
    ...); its items' texts and arguments joined, and the Response of the last event, equal what `output_items`
    makes of the whole answer.

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

    def finish(self, finish_reason: str, usage: dict, metrics: dict | None = None) -> list[dict]:
        """The last events: the open item's end (an empty message first when nothing came), then
        `response.completed` (`response.incomplete` when max_output_tokens cut the answer) with the whole Response."""
        events = [] if self.items else self._add(message_item("", "in_progress"))
        status = status_of(finish_reason)
        events += self._close("incomplete" if finish_reason == "length" else "completed")
        final = {**self.response, "status": status, "output": self.items, "usage": usage,
                 "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}
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


def _copy(obj):
    """A deep copy of JSON data (an event's item must not change when the item grows later)."""
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


class ResponseStore:
    """Stored responses (`store: true`) in memory: id -> (the Response, the chat conversation it ends), the
    `limit` most recent (the oldest dropped first). Safe to use from the event loop only."""

    def __init__(self, limit: int = MAX_STORED):
        self.limit, self._items = limit, OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        """Keep `response` and `conversation` (its input's chat messages and its output's, instructions left out)."""
        self._items[response["id"]] = (response, conversation)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, rid: str, param: str | None = None) -> tuple[dict, list[dict]]:
        """(Response, conversation) of `rid`.

        Raises:
            ResponseNotFound: no such stored response (`param`: the field that named it).
        """
        if rid not in self._items:
            raise ResponseNotFound(f"no stored response has id {rid!r:.80} (never made, made with store: false, "
                                   f"deleted, or dropped: this server keeps the {self.limit} most recent, in memory)",
                                   param=param)
        return self._items[rid]

    def delete(self, rid: str) -> None:
        """Drop `rid` (ResponseNotFound when it is not stored)."""
        self.get(rid)
        del self._items[rid]
