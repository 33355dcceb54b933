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
    """One streamed choice: `opening()`, then `delta(text)` per text delta, then `last(text, finish_reason)`."""

    def __init__(self, answers: ChatAnswers):
        self.reasoning = ReasoningStream(answers.at_start) if answers.reasoning is not None else None
        self.tools = answers.calling.stream() if answers.calling is not None else None

    def opening(self) -> dict:
        """The first delta: the role (and a named function's call)."""
        return self.tools.opening() if self.tools is not None else {"role": "assistant", "content": ""}

    def delta(self, text: str) -> dict:
        """The delta for the next text ({} when all of it is held back)."""
        thought, content = self.reasoning.delta(text) if self.reasoning is not None else ("", text)
        out = self.tools.delta(content) if self.tools is not None else ({"content": content} if content else {})
        return {"reasoning_content": thought, **out} if thought else out

    def last(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """The last delta (what was held back, the calls) and the choice's finish_reason."""
        thought, content = self.reasoning.last(text) if self.reasoning is not None else ("", text)
        if self.tools is not None:
            out, finish_reason = self.tools.last(content, finish_reason)
        else:
            out = {"content": content} if content else {}
        return ({"reasoning_content": thought, **out} if thought else out), finish_reason

    @property
    def broken_call(self) -> bool:
        """Whether the tool calls ended at one that went wrong (after `last`; `ToolStream.broken`)."""
        return self.tools is not None and self.tools.broken
