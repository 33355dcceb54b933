"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) and their mapping onto the runtime.

Field names and defaults follow the OpenAI API reference (Completions, Chat Completions; `echo` on
Completions puts the prompt before the completion, with its tokens' logprobs when `logprobs` is set,
as lm-evaluation-harness's loglikelihood requests need; streamed, the prompt is each choice's first
chunk, as vLLM streams it), with the
extensions trtllm-serve and vLLM accept: `top_k`, `stop_token_ids`, `ignore_eos`. Log-probabilities:
`logprobs` (Completions: an integer 0..20; Chat: true, with `top_logprobs` 0..20), the target's raw
distribution (`dflash_trt.runtime.logprobs`, `dflash_trt.serve.logprobs`). Logits processing, applied
exactly by the runtime (`dflash_trt.runtime.penalties`; left out or null: off): `presence_penalty`,
`frequency_penalty` (OpenAI's, over the output tokens), `logit_bias` (OpenAI's; its JSON keys are token
ids written as decimal strings), and vLLM's `repetition_penalty`, `min_tokens` (no stop, neither a stop
token nor a `stop` string, before that many tokens are out) and `min_p`; trtllm-serve's `prompt_ignore_length`
(given, the presence and frequency penalties count the prompt's tokens from that position on too, TensorRT-LLM's
scope; left out, vLLM's: the output only); vLLM's `bad_words` (strings the output never holds, each as written and
after a space: `dflash_trt.runtime.penalties.bad_word_ids`). Structured output:
`response_format` (OpenAI's json_object / json_schema, trtllm-serve's json / regex / ebnf;
`dflash_trt.runtime.guided`). Tool calling: `tools`, `tool_choice` on chat (`dflash_trt.serve.tools`); the chat
template's variables: `chat_template_kwargs`. A field this runtime cannot honour (the deprecated `functions` /
`function_call`, `echo` in chat, `best_of`, `suffix`, beam search) is refused with a message naming it unless it is
left at its "off" value, and so is any field not named here (a misspelling); fields that do not change the output
(`user`, `metadata`, `store`, `service_tier`) are accepted and ignored.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, ClassVar, Union

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt, StrictStr,
                      field_validator)

from dflash_trt.errors import InvalidRequestError, PromptTooLongError
from dflash_trt.runtime.guided import MAX_JSON_DEPTH, GuidedDecoding, check_nesting
from dflash_trt.runtime.logprobs import MAX_LOGPROBS
from dflash_trt.runtime.sampling import SamplingParams, offset_seed
from dflash_trt.serve.tools import ToolCalling
from dflash_trt.text import count

#: Most stop strings per request (OpenAI allows 4).
MAX_STOP_STRINGS = 4
#: Most choices per request: n times the prompts of one /v1/completions call.
MAX_CHOICES = 64
#: The sampling fields' ranges in OpenAI's API reference (Chat Completions, Completions, Responses: temperature
#: "between 0 and 2", top_p and the penalties likewise), the HTTP API's contract: a value outside is a 400 here
#: though the runtime would take it (`SamplingParams` takes any temperature >= 0); trtllm-serve's
#: openai_protocol.py bounds none of them. Inside, the runtime's own checks still apply (top_p 0 is refused there).
API_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
              "frequency_penalty": (-2.0, 2.0)}


def check_api_ranges(request: BaseModel) -> None:
    """Raises InvalidRequestError (param: the field) for the first of `API_RANGES`' fields that `request` sets
    outside its range (None: left out)."""
    for name, (low, high) in API_RANGES.items():
        value = getattr(request, name, None)
        if value is not None and not low <= value <= high:
            raise InvalidRequestError(f"{name} must be in [{low:g}, {high:g}] (OpenAI's range), got {value}",
                                      param=name)


def fit_context(prompt_tokens: int, max_tokens: int | None, context_len: int, what: str,
                prompt_field: str | None = None, max_tokens_field: str = "max_tokens",
                context_name: str = "the target's context") -> int:
    """The completion tokens a request may generate: `max_tokens`, or (None) all the room its prompt leaves
    in the target's context. The rule of both servers (OpenAI's and Triton's): the prompt must leave at
    least one token, and the prompt plus `max_tokens` must fit.

    Args:
        prompt_tokens: the prompt's length in tokens; `what` names it in the message ("the prompt").
        max_tokens: asked for (>= 1), or None.
        context_len: the target's context in tokens (or the server's max_seq_len below it: `context_name` names
            which in the messages).
        prompt_field / max_tokens_field: the request fields the two errors are about (their `param`), as the
            client sent them (e.g. "messages", "max_completion_tokens").
    Raises:
        PromptTooLongError: the prompt leaves no room (naming the longest prompt that fits).
        InvalidRequestError: max_tokens is more than the room left (naming the most it may be).
    """
    room = context_len - prompt_tokens
    if room < 1:
        raise PromptTooLongError(f"{what} is {prompt_tokens} tokens; {context_name} is {context_len} tokens and "
                                 f"at least one must be left to generate: shorten it to at most {context_len - 1}",
                                 param=prompt_field)
    if max_tokens is not None and max_tokens > room:
        raise InvalidRequestError(f"{what} is {count(prompt_tokens, 'token')} and {max_tokens_field} is {max_tokens}: "
                                  f"{prompt_tokens + max_tokens} > {context_name} of {context_len} tokens; ask "
                                  f"for at most {room} tokens", param=max_tokens_field)
    return room if max_tokens is None else max_tokens


def check_stops(stops: tuple[str, ...], field: str = "stop") -> tuple[str, ...]:
    """`stops` (stop strings of the request field `field`), checked: at most MAX_STOP_STRINGS, none empty.

    Raises:
        InvalidRequestError: more than MAX_STOP_STRINGS, or an empty string (which would stop before any text).
    """
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"{field} holds {len(stops)} strings; give at most {MAX_STOP_STRINGS}", param=field)
    if any(s == "" for s in stops):
        raise InvalidRequestError(f"{field} holds an empty string, which would stop before any text; remove it",
                                  param=field)
    return stops


class StreamOptions(BaseModel):
    """`stream_options`: include_usage adds a last chunk with `usage` and no choices (OpenAI); with it,
    continuous_usage_stats (vLLM's and trtllm-serve's extension, sent by load generators such as GuideLLM and
    vLLM's `bench serve`) also gives every choice chunk the usage so far.

    As trtllm-serve's and vLLM's `StreamOptions` read them (TensorRT-LLM `tensorrt_llm/serve/openai_protocol.py`,
    its use in `postprocess_handlers.py`): `include_usage` left out is true once `stream_options` is given (so
    `{"continuous_usage_stats": true}` alone gives every chunk its usage, and `{}` the usage chunk); null is off."""

    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = True  # null: off (their Optional[bool])
    continuous_usage_stats: StrictBool | None = False  # null: off (vLLM's Optional[bool])


class _Request(BaseModel):
    """Fields shared by both endpoints. Types are checked strictly by pydantic (a string "0.5" or true
    for a number, "yes" for a boolean: refused, as OpenAI refuses them); ranges by `SamplingParams`. A
    field this model does not name is refused (a misspelt `temprature` would otherwise sample at 1.0)."""

    model_config = ConfigDict(extra="forbid")
    #: fields of UNSUPPORTED that this endpoint does honour
    honoured: ClassVar[tuple[str, ...]] = ()

    model: str | None = None
    max_tokens: int | None = Field(default=None, strict=True)
    temperature: float = Field(default=1.0, strict=True)
    top_p: float = Field(default=1.0, strict=True)
    top_k: int = Field(default=0, strict=True)
    n: int = Field(default=1, strict=True)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[StrictInt] | None = None
    seed: int | None = Field(default=None, strict=True)
    ignore_eos: StrictBool = False
    # accepted and ignored: they do not change the output
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    parallel_tool_calls: StrictBool | None = None  # false: tool_choice "required" makes one call at most
    # logits processing (`SamplingParams`; None: off)
    presence_penalty: float | None = Field(default=None, strict=True)
    frequency_penalty: float | None = Field(default=None, strict=True)
    repetition_penalty: float | None = Field(default=None, strict=True)
    logit_bias: dict[str, StrictFloat] | None = None  # {token id as a decimal string: bias} (OpenAI's JSON)
    min_tokens: int | None = Field(default=None, strict=True)
    min_p: float | None = Field(default=None, strict=True)
    prompt_ignore_length: int | None = Field(default=None, strict=True)  # trtllm-serve's (`SamplingParams`)
    bad_words: list[StrictStr] | None = None  # vLLM's: words the output never holds (the app tokenizes them)
    response_format: Any = None  # guided decoding (`guided_decoding`)
    # refused unless left at their "off" value (see UNSUPPORTED)
    tools: Any = None
    tool_choice: Any = None
    echo: Any = False
    best_of: Any = None
    suffix: Any = None
    use_beam_search: Any = False
    length_penalty: Any = None
    include_stop_str_in_output: Any = False  # vLLM's
    skip_special_tokens: Any = True  # vLLM's
    functions: Any = None
    function_call: Any = None
    # trtllm-serve's own request fields (TensorRT-LLM tensorrt_llm/serve/openai_protocol.py, CompletionRequest /
    # ChatCompletionRequest): taken at their default, which is what this server does (TRTLLM_DEFAULTS); another
    # value is refused by name. A client built for trtllm-serve may send them explicitly.
    add_special_tokens: Any = None  # None: the endpoint's default (completions true, chat false)
    spaces_between_special_tokens: Any = True
    detokenize: Any = True
    return_context_logits: Any = False
    top_p_min: Any = 0.0
    early_stopping: Any = None
    truncate_prompt_tokens: Any = None
    lora_request: Any = None
    disaggregated_params: Any = None
    thinking_token_budget: Any = None
    # trtllm-serve's scheduling hints, which do not change the output: accepted and ignored (priority in [0, 1] as
    # there; cache_salt only limits which requests share cached K/V)
    priority: float | None = Field(default=None, ge=0.0, le=1.0)
    cache_salt: StrictStr | None = None

    #: add_special_tokens' default on this endpoint (trtllm-serve's)
    special_tokens_default: ClassVar[bool] = True

    def unsupported(self) -> None:
        """Raises InvalidRequestError naming the first field set to something this runtime does not do, or
        stream_options that set a field without stream (as OpenAI; an empty `{}` is taken, as trtllm-serve's and
        vLLM's check, `data.get("stream_options") and not data.get("stream")`, takes it)."""
        refuse_unless_off(self, {k: v for k, v in UNSUPPORTED.items() if k not in self.honoured}, HINTS)
        refuse_unless_off(self, {**{k: v for k, v in TRTLLM_DEFAULTS.items() if k not in self.honoured},
                                 "add_special_tokens": (None, self.special_tokens_default)}, TRTLLM_HINTS)
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true")

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple of non-empty strings (at most MAX_STOP_STRINGS).

        Raises:
            InvalidRequestError: more than MAX_STOP_STRINGS, or an empty string.
        """
        return check_stops((self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()))

    def sampling_params(self, max_tokens: int, eos_token_ids: tuple[int, ...], vocab_size: int,
                        seed_offset: int = 0, bad_words: tuple[tuple[int, ...], ...] | None = None) -> SamplingParams:
        """The runtime's SamplingParams for one choice (`bad_words`: the request's `bad_words` as token id sequences,
        `dflash_trt.runtime.penalties.bad_word_ids`). `stop_token_ids` are added to the target's
        `eos_token_ids` (vLLM's and trtllm-serve's meaning; `ignore_eos` drops the EOS ids only);
        `top_k` -1 is off (vLLM's spelling of 0); `seed_offset` (the choice's index among n) keeps the n
        choices of a seeded request different and each one reproducible. A penalty, `min_tokens` or `min_p`
        left out (None) is off; `logit_bias`'s keys become token ids (`token_logit_bias`).

        Raises:
            InvalidRequestError: a value out of range (OpenAI's: `check_api_ranges`; the runtime's: `SamplingParams`
                names the field; `min_tokens` above `max_tokens` included), a stop token id outside [0, vocab_size), a bad `logit_bias` key.
        """
        check_api_ranges(self)
        guided = self.guided_decoding()
        if guided is not None and self.ignore_eos:
            raise InvalidRequestError(f"ignore_eos and {self.guided_param()} do not go together: the answer ends at EOS "
                                      "once its format is complete; drop ignore_eos", param="ignore_eos")
        extra = tuple(self.stop_token_ids or ())
        bad = next((t for t in extra if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"stop_token_ids holds {bad}, outside the vocabulary [0, {vocab_size})")
        stops = tuple(dict.fromkeys(extra if self.ignore_eos else (*eos_token_ids, *extra)))
        return SamplingParams(temperature=self.temperature, top_k=0 if self.top_k == -1 else self.top_k,
                              top_p=self.top_p, max_tokens=max_tokens, stop_token_ids=stops,
                              seed=offset_seed(self.seed, seed_offset), logprobs=self.num_logprobs(),
                              presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0,
                              repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                              logit_bias=self.token_logit_bias(vocab_size), min_tokens=self.min_tokens or 0,
                              min_p=self.min_p or 0.0, guided=guided, prompt_ignore_length=self.prompt_ignore_length,
                              bad_words=bad_words)

    def guided_param(self) -> str:
        """The request field its guided decoding comes from ("response_format"; chat: "tool_choice" for a forced
        tool call)."""
        return "response_format"

    def guided_decoding(self) -> GuidedDecoding | None:
        """`response_format` as the runtime's GuidedDecoding, or None for text: OpenAI's `{"type": "json_object"}`
        and `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`, and trtllm-serve's
        `{"type": "json", "schema": {...}}`, `{"type": "regex", "regex": "..."}`, `{"type": "ebnf", "ebnf": "..."}`.

        Raises:
            InvalidRequestError: naming response_format: another type, or its schema / regex / grammar missing.
        """
        fmt = self.response_format
        if fmt is None:
            return None
        kinds = "text, json_object, json_schema, json, regex, ebnf"
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise InvalidRequestError(f'response_format must be an object with a "type" ({kinds}), got {fmt!r}',
                                      param="response_format")

        def field(container: dict, key: str, kind: type, where: str):
            value = container.get(key) if isinstance(container, dict) else None
            if not isinstance(value, kind):
                raise InvalidRequestError(f"response_format of type {fmt['type']!r} needs {where} "
                                          f"({'an object' if kind is dict else 'a string'})", param="response_format")
            return value

        kind = fmt["type"]
        try:
            return self._guided(fmt, kind, kinds, field)
        except InvalidRequestError as exc:  # GuidedDecoding's own checks (an unsupported schema keyword...)
            raise InvalidRequestError(str(exc), param="response_format") from None

    @staticmethod
    def _guided(fmt: dict, kind: str, kinds: str, field) -> GuidedDecoding | None:
        if kind == "text":
            return None
        if kind == "json_object":
            return GuidedDecoding(json_object=True)
        if kind == "json_schema":
            return GuidedDecoding(json=field(field(fmt, "json_schema", dict, "json_schema"), "schema", dict,
                                             "json_schema.schema"))
        if kind == "json":
            return GuidedDecoding(json=field(fmt, "schema", dict, "schema"))
        if kind == "regex":
            return GuidedDecoding(regex=field(fmt, "regex", str, "regex"))
        if kind == "ebnf":
            return GuidedDecoding(grammar=field(fmt, "ebnf", str, "ebnf"))
        raise InvalidRequestError(f"response_format type {kind!r} is not supported by this server; use one of {kinds}",
                                  param="response_format")

    def token_logit_bias(self, vocab_size: int) -> dict[int, float] | None:
        """`logit_bias` keyed by token id (OpenAI's JSON writes the ids as strings: {"504": 5}), or None.

        Raises:
            InvalidRequestError: naming logit_bias and the key: not a decimal integer, or outside [0, vocab_size).
        """
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise InvalidRequestError(f"logit_bias key {key!r} is not a token id; write each id as a decimal "
                                          'string, e.g. {"504": 5}', param="logit_bias")
            if int(key) >= vocab_size:
                raise InvalidRequestError(f"logit_bias key {key!r} is outside the vocabulary [0, {vocab_size})",
                                          param="logit_bias")
            out[int(key)] = bias
        return out or None

    def num_logprobs(self) -> int | None:
        """Alternatives per token asked for (`SamplingParams.logprobs`), or None: no logprobs."""
        return None

    def check_n(self, prompts: int = 1) -> None:
        """Raises InvalidRequestError: n < 1, or more than MAX_CHOICES choices in all."""
        if self.n < 1:
            raise InvalidRequestError(f"n must be >= 1, got {self.n}")
        if self.n * prompts > MAX_CHOICES:
            raise InvalidRequestError(f"n ({self.n}) times the prompts ({prompts}) is {self.n * prompts} choices; "
                                      f"this server returns at most {MAX_CHOICES} per request")


#: chat_template_kwargs keys the server gives the template itself (the request's messages and tools, the
#: generation prompt) or that `apply_chat_template` reads as its own arguments
RESERVED_TEMPLATE_KWARGS = ("self", "conversation", "conversations", "messages", "tools", "documents", "chat_template",
                            "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
                            "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                            "tokenizer_kwargs")

#: field -> the values that mean "off" (accepted); anything else is refused
UNSUPPORTED = {
    "tools": (None, []), "tool_choice": (None, "none"),
    "echo": (False, None), "best_of": (None, 1), "suffix": (None, ""), "use_beam_search": (False, None),
    "length_penalty": (None, 1, 1.0), "functions": (None, []), "function_call": (None, "none"),
    "include_stop_str_in_output": (False, None), "skip_special_tokens": (True, None),
}
HINTS = {"best_of": "use n for several completions", "echo": "/v1/completions has echo; here, prepend the prompt yourself",
         "functions": "use tools", "function_call": "use tool_choice",
         "tools": "tool calling is on /v1/chat/completions", "tool_choice": "tool calling is on /v1/chat/completions",
         "include_stop_str_in_output": "the text ends before the stop string (OpenAI's behaviour)",
         "skip_special_tokens": "special tokens are always left out of the text"}


#: trtllm-serve's request fields this server takes only at their default (TensorRT-LLM
#: tensorrt_llm/serve/openai_protocol.py): field -> the values that mean the default (add_special_tokens: per endpoint)
TRTLLM_DEFAULTS = {
    "spaces_between_special_tokens": (True, None), "detokenize": (True, None), "return_context_logits": (False, None),
    "top_p_min": (0.0, 0, None), "early_stopping": (None,), "truncate_prompt_tokens": (None,), "lora_request": (None,),
    "disaggregated_params": (None,), "thinking_token_budget": (None,),
}
TRTLLM_HINTS = {"add_special_tokens": "the prompt is tokenized as the endpoint's default: completions with the "
                                      "tokenizer's special tokens, chat with the chat template's only",
                "detokenize": "the answer is always text", "truncate_prompt_tokens": "shorten the prompt yourself",
                "top_p_min": "use top_p", "lora_request": "no LoRA adapters are served",
                "thinking_token_budget": "use max_tokens",
                # trtllm-serve's ChatCompletionRequest has no such field; its CompletionRequest's gives each choice the
                # prompt's logits (`CompletionRequest.return_context_logits`)
                "return_context_logits": "chat completions return no logits, as trtllm-serve's; /v1/completions with "
                                         "return_context_logits: true gives each choice the prompt's context_logits"}


#: how deeply a request's fields may nest (a tool's parameters schema may nest MAX_JSON_DEPTH levels, inside its tool)
MAX_BODY_DEPTH = MAX_JSON_DEPTH + 8


def check_request_nesting(request: BaseModel) -> None:
    """Raises InvalidRequestError (param: the field) when a field of `request` nests more than MAX_BODY_DEPTH levels
    of objects and arrays (the body parser takes ~1000: what then copies or encodes them recursively would fail)."""
    for name, value in request:
        check_nesting(value.model_dump() if isinstance(value, BaseModel) else value, MAX_BODY_DEPTH, name,
                      "flatten it", param=name)


def refuse_unless_off(request: BaseModel, off: dict[str, tuple], hints: dict[str, str]) -> None:
    """Raises InvalidRequestError (param: the field) for the first field of `off` (field -> the values that mean
    "off", of their exact types) that `request` sets to another value, with its hint from `hints` if any."""
    for name, values in off.items():
        value = getattr(request, name)
        if not any(value == v and type(value) is type(v) for v in values):
            hint = f" ({hints[name]})" if name in hints else ""
            raise InvalidRequestError(f"{name}={value!r:.80} is not supported by this server (DFlash runtime); "
                                      f"leave it out{hint}", param=name)


def jsonable(value: Any) -> bool:
    """Whether json.dumps takes `value` (what a validation error's `input` is shown with)."""
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _check_logprobs(value: int | None, field: str) -> None:
    """Raises InvalidRequestError unless `value` is None or in [0, MAX_LOGPROBS]."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequestError(f"{field} must be an integer in [0, {MAX_LOGPROBS}], got {value}", param=field)


class CompletionRequest(_Request):
    """POST /v1/completions. `prompt`: a string, a list of strings, a list of token ids, or a list of
    lists of token ids (one completion per prompt, times n). `max_tokens` defaults to 16 (OpenAI)."""

    honoured: ClassVar[tuple[str, ...]] = ("echo", "return_context_logits")

    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    logprobs: int | None = Field(default=None, strict=True)
    echo: StrictBool = False
    # trtllm-serve's: each choice of a whole (not streamed) answer gets `context_logits`, the target's raw logits at
    # every position of its prompt ([prompt tokens][V] floats, its `completion_response_post_processor`); its stream
    # chunks have no such field, so a stream is answered without them (and they are not computed)
    return_context_logits: StrictBool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """One message for a prompt of no accepted shape (pydantic would list each union member's complaint)."""
        def kind(x: Any) -> str:
            if isinstance(x, str):
                return "a string"
            if type(x) is int:
                return "a token id"
            if isinstance(x, list) and all(type(t) is int for t in x):
                return "a list of token ids"
            return f"{json.dumps(x)[:40]}" if isinstance(x, (list, dict, float, bool)) or x is None else repr(x)[:40]

        if isinstance(value, str):
            return value
        if isinstance(value, list):
            kinds = {kind(x) for x in value}
            if len(kinds) <= 1 and kinds <= {"a string", "a token id", "a list of token ids"}:
                return value
            bad = sorted(k for k in kinds if k not in ("a string", "a token id", "a list of token ids"))
            found = f"an element {bad[0]}" if bad else "a list mixing " + " and ".join(sorted(kinds))
        else:
            found = f"{json.dumps(value)[:40]}" if jsonable(value) else type(value).__name__
        raise ValueError("must be a string, a list of strings, a list of token ids (integers) or a list of "
                         f"lists of token ids; got {found}")

    def num_logprobs(self) -> int | None:
        """`logprobs`: the most likely tokens listed per position (0: the sampled token's only), or None.

        Raises:
            InvalidRequestError: outside [0, MAX_LOGPROBS].
        """
        _check_logprobs(self.logprobs, "logprobs")
        return self.logprobs

    def sampling_params(self, max_tokens: int, eos_token_ids: tuple[int, ...], vocab_size: int,
                        seed_offset: int = 0, bad_words: tuple[tuple[int, ...], ...] | None = None) -> SamplingParams:
        """`_Request.sampling_params`, with the prompt's logprobs asked for when `echo` and `logprobs` are set, and its
        context logits with `return_context_logits` (not streamed)."""
        params = super().sampling_params(max_tokens, eos_token_ids, vocab_size, seed_offset, bad_words)
        if self.return_context_logits and not self.stream:
            params = replace(params, return_context_logits=True)
        return replace(params, prompt_logprobs=self.logprobs) if self.echo and self.logprobs is not None else params

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids.

        Raises:
            InvalidRequestError: an empty list or an empty prompt.
        """
        p = self.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [list(p)]
        else:
            items = list(p)
        if not items:
            raise InvalidRequestError("prompt is an empty list; give a string, a list of strings or token ids")
        for i, item in enumerate(items):
            if len(item) == 0:
                raise InvalidRequestError(f"prompt {i} is empty; give some text or token ids")
        return items


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions. `messages` as OpenAI gives them (string content or text parts);
    `max_completion_tokens` is the newer name of `max_tokens` (either; default: what fits in the
    target's context)."""

    honoured: ClassVar[tuple[str, ...]] = ("tools", "tool_choice")
    special_tokens_default: ClassVar[bool] = False

    messages: list[Any]
    # trtllm-serve's (and vLLM's) chat fields, taken at their default (`unsupported`)
    add_generation_prompt: Any = True
    documents: Any = None
    chat_template: Any = None
    max_completion_tokens: int | None = Field(default=None, strict=True)
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(default=None, strict=True)
    chat_template_kwargs: dict[str, Any] | None = None  # the chat template's variables (vLLM's, trtllm-serve's)
    _tools: ToolCalling | None = PrivateAttr(default=None)

    def unsupported(self) -> None:
        """`_Request.unsupported`, and the chat fields trtllm-serve has that this server takes only at their default:
        add_generation_prompt true, no documents, no per-request chat_template."""
        super().unsupported()
        refuse_unless_off(self, {"add_generation_prompt": (True, None), "documents": (None, []),
                                 "chat_template": (None,)},
                          {"add_generation_prompt": "the answer always starts a new assistant turn",
                           "chat_template": "the target's own chat template is used"})

    def check_tool_messages(self) -> None:
        """Raises InvalidRequestError (param "messages[i].tool_call_id", i from 0 as OpenAI counts) for a "tool"
        message without a tool_call_id string: a tool result answers one call of an assistant message, named by
        its id (OpenAI refuses it with a 400 too)."""
        for i, m in enumerate(self.messages):
            if isinstance(m, dict) and m.get("role") == "tool" and not isinstance(m.get("tool_call_id"), str):
                field = f"messages[{i}].tool_call_id"
                value = m.get("tool_call_id")
                got = "missing" if value is None else f"{json.dumps(value)[:40]}, not a string"
                raise InvalidRequestError(f"{field} is {got}; a tool message answers one tool call: give the id of "
                                          'that call in the assistant message\'s tool_calls, e.g. "tool_call_id": '
                                          '"call_1"', param=field)

    def template_kwargs(self) -> dict[str, Any]:
        """`chat_template_kwargs` (e.g. {"enable_thinking": false}, Qwen3's switch), or {}.

        Raises:
            InvalidRequestError: a key that the server sets itself (RESERVED_TEMPLATE_KWARGS) or that is not a name.
        """
        from dflash_trt.api import check_text

        kwargs = self.chat_template_kwargs or {}
        bad = next((k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS or not k.isidentifier()), None)
        if bad is not None:
            raise InvalidRequestError(f"chat_template_kwargs holds {bad!r}, which the server sets itself or which is "
                                      f"not a template variable; leave it out (reserved: "
                                      f"{', '.join(RESERVED_TEMPLATE_KWARGS)})", param="chat_template_kwargs")
        try:  # a value the template prints reaches the tokenizer
            check_text(json.dumps(kwargs, ensure_ascii=False), "chat_template_kwargs")
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), param="chat_template_kwargs") from None
        return kwargs

    def tool_calling(self, parser: str | None) -> ToolCalling | None:
        """The request's tool calling (`ToolCalling.from_request`; `parser`: the server's --tool-parser), kept for
        `guided_decoding`.

        Raises:
            InvalidRequestError: bad tools or tool_choice (naming the field); `stop` or `stop_token_ids` with a
                forced call (they would cut its JSON).
        """
        fmt = self.response_format
        self._tools = ToolCalling.from_request(self.tools, self.tool_choice, self.parallel_tool_calls, parser,
                                               fmt is not None and not (isinstance(fmt, dict) and
                                                                        fmt.get("type") == "text"))
        for name in ("stop", "stop_token_ids"):
            if self._tools is not None and self._tools.forced() and getattr(self, name):
                raise InvalidRequestError(f"{name} and tool_choice {self.tool_choice!r:.60} do not go together: a stop "
                                          "would cut the call's JSON, which ends by itself; leave it out", param=name)
        return self._tools

    def guided_param(self) -> str:
        """"tool_choice" when a forced tool call gives the grammar (`tool_calling`), else "response_format"."""
        return "tool_choice" if self._tools is not None and self._tools.guided() is not None else "response_format"

    def guided_decoding(self) -> GuidedDecoding | None:
        """The grammar of a forced tool call (`ToolCalling.guided`), else `response_format`'s (`_Request`)."""
        forced = self._tools.guided() if self._tools is not None else None
        return forced if forced is not None else super().guided_decoding()

    def num_logprobs(self) -> int | None:
        """`top_logprobs` (0 when left out) when `logprobs` is true, else None.

        Raises:
            InvalidRequestError: top_logprobs outside [0, MAX_LOGPROBS], or set without logprobs: true (OpenAI's rule).
        """
        _check_logprobs(self.top_logprobs, "top_logprobs")
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs: true; set both, or leave top_logprobs out",
                                          param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def max_tokens_field(self) -> str:
        """The name this request gave its completion limit ("max_completion_tokens" or "max_tokens")."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens or max_tokens (InvalidRequestError when both are given and differ, or below 1,
        naming the field the request used)."""
        a, b = self.max_completion_tokens, self.max_tokens
        if a is not None and b is not None and a != b:
            raise InvalidRequestError(f"max_tokens ({b}) and max_completion_tokens ({a}) differ; give one of them")
        want = a if a is not None else b
        if want is not None and want < 1:
            field = self.max_tokens_field()
            raise InvalidRequestError(f"{field} must be >= 1, got {want}", param=field)
        return want

