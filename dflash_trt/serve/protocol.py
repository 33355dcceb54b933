"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) and their mapping onto the runtime.

Field names and defaults follow the OpenAI API reference (Completions, Chat Completions), with the
extensions trtllm-serve and vLLM accept: `top_k`, `stop_token_ids`, `ignore_eos`. A field this
runtime cannot honour (log-probabilities, penalties, logit bias, tools, JSON mode, `echo`,
`best_of`, `suffix`) is refused with a message naming it, never silently ignored; fields that do not
change the output (`user`, `metadata`, `store`, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from dflash_trt.errors import InvalidRequestError
from dflash_trt.runtime.sampling import SamplingParams

#: Most stop strings per request (OpenAI allows 4).
MAX_STOP_STRINGS = 4
#: Most choices per request: n times the prompts of one /v1/completions call.
MAX_CHOICES = 64


class StreamOptions(BaseModel):
    """`stream_options`: include_usage adds a last chunk with `usage` and no choices (OpenAI)."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by both endpoints. Types are checked by pydantic (strict for numbers: a string
    "0.5" is refused, as OpenAI refuses it); ranges by `SamplingParams`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, strict=True)
    temperature: float = Field(default=1.0, strict=True)
    top_p: float = Field(default=1.0, strict=True)
    top_k: int = Field(default=0, strict=True)
    n: int = Field(default=1, strict=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, strict=True)
    ignore_eos: bool = False
    # refused unless left at their "off" value (see UNSUPPORTED)
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = 0
    frequency_penalty: Any = 0
    repetition_penalty: Any = None
    logit_bias: Any = None
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    echo: Any = False
    best_of: Any = None
    suffix: Any = None

    def unsupported(self) -> None:
        """Raises InvalidRequestError naming the first field set to something this runtime does not do."""
        for name, off in UNSUPPORTED.items():
            value = getattr(self, name)
            if value not in off:
                raise InvalidRequestError(f"{name}={value!r} is not supported by this server (DFlash runtime); "
                                          f"leave it out{'' if name not in HINTS else ' (' + HINTS[name] + ')'}")

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple of non-empty strings (at most MAX_STOP_STRINGS).

        Raises:
            InvalidRequestError: more than MAX_STOP_STRINGS, or an empty string.
        """
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop holds {len(stops)} strings; give at most {MAX_STOP_STRINGS}")
        if any(s == "" for s in stops):
            raise InvalidRequestError('stop holds an empty string, which would stop before any text; remove it')
        return stops

    def sampling_params(self, max_tokens: int, seed_offset: int = 0) -> SamplingParams:
        """The runtime's SamplingParams for one choice; `seed_offset` (the choice's index among n) keeps
        the n choices of a seeded request different and each one reproducible.

        Raises:
            InvalidRequestError: a value out of range (`SamplingParams` names the field).
        """
        seed = None if self.seed is None else self.seed + seed_offset
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, max_tokens=max_tokens,
                              stop_token_ids=self.stop_token_ids, seed=seed, ignore_eos=self.ignore_eos)

    def check_n(self, prompts: int = 1) -> None:
        """Raises InvalidRequestError: n < 1, or more than MAX_CHOICES choices in all."""
        if self.n < 1:
            raise InvalidRequestError(f"n must be >= 1, got {self.n}")
        if self.n * prompts > MAX_CHOICES:
            raise InvalidRequestError(f"n ({self.n}) times the prompts ({prompts}) is {self.n * prompts} choices; "
                                      f"this server returns at most {MAX_CHOICES} per request")


#: field -> the values that mean "off" (accepted); anything else is refused
UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None), "repetition_penalty": (None, 1, 1.0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
    "echo": (False, None), "best_of": (None, 1), "suffix": (None, ""),
}
HINTS = {"best_of": "use n for several completions", "echo": "prepend the prompt yourself"}


class CompletionRequest(_Request):
    """POST /v1/completions. `prompt`: a string, a list of strings, a list of token ids, or a list of
    lists of token ids (one completion per prompt, times n). `max_tokens` defaults to 16 (OpenAI)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]

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

    messages: list[Any]
    max_completion_tokens: int | None = Field(default=None, strict=True)

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens or max_tokens (InvalidRequestError when both are given and differ)."""
        a, b = self.max_completion_tokens, self.max_tokens
        if a is not None and b is not None and a != b:
            raise InvalidRequestError(f"max_tokens ({b}) and max_completion_tokens ({a}) differ; give one of them")
        return a if a is not None else b

