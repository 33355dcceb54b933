"""Reasoning outputs on /v1/chat/completions: the `<think>...</think>` part of a reasoning model's answer goes to
`message.reasoning_content` (streamed: `delta.reasoning_content`), the rest to `content`, as trtllm-serve's
`--reasoning_parser` and vLLM's `--reasoning-parser` split it (`dflash-trt serve --reasoning-parser`).

Parsers (`REASONING_PARSERS`, trtllm-serve's names):
- "deepseek-r1": the answer starts inside the reasoning (DeepSeek-R1's chat template ends the prompt with
  `<think>\\n`): everything before `</think>` is reasoning (a leading `<think>` dropped), everything after it
  content; without `</think>` (thinking cut by max_tokens) the whole answer is reasoning.
- "qwen3": reasoning only where the answer writes `<think>` (Qwen3 with thinking on; with `enable_thinking: false`
  in `chat_template_kwargs` its template closes the thinking in the prompt and the answer is all content): the
  text between `<think>` and `</think>` (or the end) is reasoning, the text around it content.

A JSON answer (a json_schema / json_object `response_format`, a forced tool call) is all content: a `<think>` in one
of its strings is text. A regex or grammar answer holds reasoning only where it writes `<think>`, so it is read as
"qwen3" reads answers (`dflash_trt.serve.chat.ChatAnswers`). Tool calls ("auto") are parsed from the content.
Streamed, text that could begin a tag is held back until it is known, so the deltas of each field join to the
non-streamed message's; each delta's text is looked at once (`ReasoningStream`: work linear in the answer's length).
"""

from __future__ import annotations

from dflash_trt.text import partial_suffix

REASONING_PARSERS = ("deepseek-r1", "qwen3")
START, END = "<think>", "</think>"


def split_reasoning(text: str, at_start: bool) -> tuple[str, str]:
    """(reasoning, content) of an answer.

    Args:
        text: the answer.
        at_start: the answer begins inside the reasoning ("deepseek-r1"); else reasoning starts at `<think>`.
    Returns:
        reasoning and content ("" where there is none): `<think>` and `</think>` belong to neither.
    """
    before = ""
    if at_start:
        body = text[len(START):] if text.startswith(START) else text
    else:
        i = text.find(START)
        if i < 0:
            return "", text
        before, body = text[:i], text[i + len(START):]
    reasoning, tag, after = body.partition(END)
    return reasoning, before + after


def reasoning_token_count(token_ids: list[int], decode, at_start: bool) -> int:
    """How many of an answer's tokens are its reasoning (the Responses API's `usage.output_tokens_details.
    reasoning_tokens`): the tokens that hold the text between `<think>` and `</think>` (`split_reasoning`'s
    reasoning), the tags' own tokens not counted; from the first token when the answer starts inside the reasoning
    ("deepseek-r1" without `<think>`), to the last token while it is not closed (cut by max_tokens); 0 when the
    answer has no reasoning or an empty one (`<think></think>`).

    The tags are left out as vLLM counts them (`BaseThinkingReasoningParser.count_reasoning_tokens`, the tokens
    strictly between the start and end tokens, vllm-project/vllm#14335) and as OpenAI means the field (the tokens
    spent reasoning). trtllm-serve, which this server matches elsewhere, reports no reasoning_tokens at all
    (tensorrt_llm/serve/postprocess_handlers.py builds its usage without completion_tokens_details), so vLLM's is
    the number users compare against. With a tokenizer whose tags are single tokens (DeepSeek-R1, Qwen3) this is
    exactly vLLM's count; where a tag is several tokens, a token holding both a tag's and the reasoning's
    characters counts as reasoning.

    Args:
        token_ids: the answer's token ids.
        decode: token ids -> text (the target tokenizer's decode).
        at_start: as `split_reasoning`.
    Returns:
        the count; the tokens are located by decoding their prefixes (a binary search: O(log n) decodes).
    """
    n = len(token_ids)
    if not n:
        return 0
    text = decode(token_ids)
    if at_start:
        begin = len(START) if text.startswith(START) else 0
    else:
        i = text.find(START)
        if i < 0:
            return 0
        begin = i + len(START)
    close = text.find(END, begin)
    end = len(text) if close < 0 else close  # the reasoning is text[begin:end]
    if end <= begin:
        return 0

    def first(holds) -> int:
        """The fewest leading tokens whose text `holds` (a property that, once true, stays true; true of all)."""
        lo, hi = 1, n
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if holds(decode(token_ids[:mid])) else (mid + 1, hi)
        return lo

    # the reasoning's first character is in token first(len > begin) - 1, its last in token first(len >= end) - 1;
    # from the first token when the answer starts inside it, to the last while it is not closed
    last = n if close < 0 else first(lambda t: len(t) >= end)
    return last - (1 if begin == 0 else first(lambda t: len(t) > begin)) + 1


class ReasoningStream:
    """One streamed choice's split: `delta(text)` and `last(text)` give (reasoning delta, content delta); each
    field's deltas join to `split_reasoning` of the whole answer, and each delta is what `split_reasoning` of the
    text so far, without an end that may still become a tag (`partial_suffix`), adds to the last one's.

    Work is linear in the answer's length: the text is not kept, only the end held back (a proper beginning of a
    tag, under 9 characters) and where the split stands (before `<think>`, in the reasoning, after `</think>`), and
    each delta's new text is searched once for the tag that ends the part it is in. (A tag never straddles the end
    of what was sent: that end is held back while it may begin one.)"""

    def __init__(self, at_start: bool):
        self.held = ""  # the text not sent yet: what may still begin a tag
        # where the text sent ends: "start" (deepseek-r1, nothing sent: a leading <think> is dropped), "before"
        # (qwen3, no <think> yet: content), "reasoning" (after <think>, no </think> yet), "after" (content)
        self.part = "start" if at_start else "before"

    def _split(self, new: str) -> tuple[str, str]:
        """(reasoning, content) that `new`, the text after what was sent, adds to the split (`split_reasoning`)."""
        reasoning, content = "", ""
        if self.part == "start":
            self.part = "reasoning"
            if new.startswith(START):
                new = new[len(START):]
        if self.part == "before":
            i = new.find(START)
            if i < 0:
                return "", new
            content, new, self.part = new[:i], new[i + len(START):], "reasoning"
        if self.part == "reasoning":
            reasoning, tag, after = new.partition(END)
            if not tag:
                return reasoning, content
            new, self.part = after, "after"
        return reasoning, content + new

    def _send(self, text: str, upto_end: bool) -> tuple[str, str]:
        self.held += text
        keep = 0 if upto_end or "<" not in self.held else partial_suffix(self.held, (START, END))  # (tags begin "<")
        new, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return self._split(new) if new else ("", "")

    def delta(self, text: str) -> tuple[str, str]:
        """The reasoning and content to send for the choice's next text (a possible tag held back)."""
        return self._send(text, False)

    def last(self, text: str) -> tuple[str, str]:
        """The rest of the reasoning and content, at the choice's end."""
        return self._send(text, True)
