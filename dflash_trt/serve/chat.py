"""A chat choice's answer as OpenAI returns it: the text split into `reasoning_content` and `content`
(`dflash_trt.serve.reasoning`), then tool calls read from the content (`dflash_trt.serve.tools`; as the text grows,
`dflash_trt.serve.tool_stream`); whole (`ChatAnswers.message`) or as stream deltas (`ChatAnswers.stream`) that
join to the same message."""

from __future__ import annotations

from dflash_trt.serve.reasoning import ReasoningStream, reasoning_token_count, split_reasoning
from dflash_trt.serve.tools import ToolCalling


class ChatAnswers:
    """How the answers of one chat request become messages.

    Args:
        calling: the request's tool calling, or None.
        reasoning_parser: the server's --reasoning-parser ("deepseek-r1", "qwen3"), or None: no reasoning split.
        guided: the kind of the request's guided decoding (`GuidedDecoding.kind`: "json", "json_object",
            "regex", "grammar"), or None. A JSON answer (a schema, JSON mode, a forced tool call) is never split
            (a `<think>` inside one of its strings is text); a regex or grammar answer holds reasoning only where
            it writes `<think>`.
    """

    def __init__(self, calling: ToolCalling | None, reasoning_parser: str | None, guided: str | None):
        self.calling, self.parser = calling, reasoning_parser
        self.reasoning = None if guided in ("json", "json_object") else reasoning_parser  # the split, if any
        self.at_start = reasoning_parser == "deepseek-r1" and guided is None

    @property
    def plain(self) -> bool:
        """Whether the text is the content, unchanged (no reasoning split, no tool calls)."""
        return self.calling is None and self.parser is None

    def message(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """(`message`, `finish_reason`) of a choice whose answer is `text`, finished for `finish_reason`."""
        reasoning, content = split_reasoning(text, self.at_start) if self.reasoning is not None else ("", text)
        if self.calling is not None:
            msg, finish_reason = self.calling.message(content, finish_reason)
        else:
            msg = {"role": "assistant", "content": content}
        if self.parser is not None:
            msg["reasoning_content"] = reasoning or None
            if msg["content"] == "":  # all reasoning: content null, as vLLM's
                msg["content"] = None
        return msg, finish_reason

    def reasoning_tokens(self, token_ids: list[int], decode) -> int:
        """How many of the answer's tokens are reasoning (`reasoning_token_count`); 0 without a reasoning split."""
        return 0 if self.reasoning is None else reasoning_token_count(token_ids, decode, self.at_start)

    def stream(self) -> "ChatStream":
        """The state of one streamed choice."""
        return ChatStream(self)


class ChatStream:
    """One streamed choice: `opening()`, then `delta(text)` per text delta, then `last(text, finish_reason)`.

    The role comes in the first delta, with `content` as OpenAI streams it: "" when the answer is text, null when it
    is a tool call (a named function's, or under "auto" / "required" an answer that begins with a call). Under "auto"
    / "required" that is known only once the reader is sure of the answer's first content or call, so the opening
    waits for it (`opening` is None) and rides on the first delta with something in it: the content's first text
    (or, where reasoning comes first, null: more content may follow), or the first call with content null; an answer
    that ends with neither gets it in its last delta, content as the non-streamed message's ("" or null)."""

    def __init__(self, answers: ChatAnswers):
        self.reasoning = ReasoningStream(answers.at_start) if answers.reasoning is not None else None
        self.tools = answers.calling.stream() if answers.calling is not None else None
        self.split = answers.parser is not None  # an empty content is null (`ChatAnswers.message`)
        self.opened = True  # whether the role was sent

    def opening(self) -> dict | None:
        """The first delta: the role (and a named function's call); None when it waits for the first delta that
        says whether the content is text or null (tool calls "auto" / "required")."""
        if self.tools is None:
            return {"role": "assistant", "content": ""}
        out = self.tools.opening()
        self.opened = out is not None
        return out

    def _opened(self, out: dict, final: bool = False) -> dict:
        """`out` with the role in front when it is the first delta to say something (`final`: the last one)."""
        if self.opened or not (out or final):
            return out
        self.opened = True
        if "content" in out:
            content = out["content"]
        else:  # a call first (or reasoning: content may follow), or nothing at all: the message's empty content
            content = None if out.get("tool_calls") or self.split or not final else ""
        return {"role": "assistant", "content": content, **{k: v for k, v in out.items() if k != "content"}}

    def open_now(self) -> dict:
        """The role's delta, sent now if it was not yet ({} if it was): a chunk of logprobs only must carry it (the
        first chunk of a choice has the role); the content is null (text may follow)."""
        return {} if self.opened else self._opened({"content": None})

    def delta(self, text: str) -> dict:
        """The delta for the next text ({} when all of it is held back)."""
        thought, content = self.reasoning.delta(text) if self.reasoning is not None else ("", text)
        out = self.tools.delta(content) if self.tools is not None else ({"content": content} if content else {})
        return self._opened({"reasoning_content": thought, **out} if thought else out)

    def last(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """The last delta (what was held back, the calls) and the choice's finish_reason."""
        thought, content = self.reasoning.last(text) if self.reasoning is not None else ("", text)
        if self.tools is not None:
            out, finish_reason = self.tools.last(content, finish_reason)
        else:
            out = {"content": content} if content else {}
        return self._opened({"reasoning_content": thought, **out} if thought else out, final=True), finish_reason

    @property
    def broken_call(self) -> bool:
        """Whether the tool calls ended at one that went wrong (after `last`; `ToolStream.broken`)."""
        return self.tools is not None and self.tools.broken
