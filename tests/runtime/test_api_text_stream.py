"""`Pipeline.generate(..., on_text=)`: streamed text deltas, decoded incrementally and held back before a possible stop
string as the server streams them (`StopText`), whose concatenation is exactly each result's `text`; and callbacks
whose arity does not fit the request refused before any work."""

from __future__ import annotations

import pytest
import torch

from dflash_trt.errors import InvalidRequestError
from dflash_trt.runtime.sampling import SamplingParams

PROMPT = "東京 🚀 rocket launch. 東京 🚀 rocket launch. 東京"  # SmolLM2 continues it, emoji and kanji split over tokens
MAX = 16


@pytest.fixture(scope="module")
def reference(smollm2_pipeline):
    """(pipeline, the greedy continuation's token ids, its text)."""
    pipe = smollm2_pipeline
    [ref] = pipe.generate([PROMPT], SamplingParams(max_tokens=MAX, ignore_eos=True), "ar")
    return pipe, ref.token_ids, ref.text


def stream(pipe, params: list[SamplingParams], mode: str):
    """generate with on_text and on_tokens: (results, each prompt's deltas, each prompt's ids from on_tokens, each
    prompt's deltas joined when on_finished got its result)."""
    deltas: dict[int, list[str]] = {i: [] for i in range(len(params))}
    ids: dict[int, list[int]] = {i: [] for i in range(len(params))}
    at_finish: dict[int, str] = {}
    results = pipe.generate([PROMPT] * len(params), params, mode,
                            on_tokens=lambda i, toks, *rest: ids[i].extend(toks),
                            on_text=lambda i, d: deltas[i].append(d),
                            on_finished=lambda i, r: at_finish.__setitem__(i, "".join(deltas[i])))
    return results, deltas, ids, at_finish


@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_streamed_deltas_join_to_the_result_text(reference, mode):
    """Three requests in one batch: no stop string; one starting inside the token " rocket" and ending in the next
    (" launch"); one spanning the byte-level tokens of "京 🚀" (a stop string cut mid-character); and one whose
    beginning " rocket" appears but which never completes (held back, then sent at the end). Each prompt's deltas
    join to its result's text, exactly, by the time on_finished gets it; no delta holds a broken character
    (U+FFFD) or any part of the stop string that ended the request."""
    pipe, ref, text = reference
    assert any(pipe.decode([t]) in ("\ufffd", " \ufffd") for t in ref)  # characters split over tokens: a naive
    assert "".join(pipe.decode([t]) for t in ref) != text  # per-chunk decode garbles them
    at = text.index(" rocket")
    mid = text[at + 2 : at + 9]  # "ocket l"
    kanji = text[text.index("京 🚀") :][:3]
    assert (mid, kanji) == ("ocket l", "京 🚀")
    params = [SamplingParams(max_tokens=MAX, ignore_eos=True),
              SamplingParams(max_tokens=MAX, ignore_eos=True, stop=mid),
              SamplingParams(max_tokens=MAX, ignore_eos=True, stop=["no such text", kanji]),
              SamplingParams(max_tokens=MAX, ignore_eos=True, stop=" rocket ship")]
    results, deltas, ids, at_finish = stream(pipe, params, mode)
    assert [r.text for r in results] == [text, text[: text.index(mid)], text[: text.index(kanji)], text]
    assert [r.finish_reason for r in results] == ["length", "stop", "stop", "length"]
    for i, r in enumerate(results):
        assert "".join(deltas[i]) == r.text == at_finish[i]
        assert all(d and "\ufffd" not in d for d in deltas[i])
        assert ids[i] == r.token_ids == ref[: len(r.token_ids)]
    assert len(deltas[0]) > 3  # streamed as the tokens came, not in one piece at the end
    if mode == "ar":  # a token a call: " rocket" is a delta of its own, except where it may begin " rocket ship"
        assert " rocket" in deltas[0] and " rocket launch" in deltas[3] and " rocket" not in deltas[3]


def test_a_length_cut_character_is_in_the_last_delta_as_in_the_text(smollm2_pipeline):
    """max_tokens ending inside a multi-byte character: the result's text ends in U+FFFD (the decode of its bytes so
    far), and so do the deltas joined (the last delta: it was held back while more bytes could come)."""
    pipe = smollm2_pipeline
    deltas: list[str] = []
    [r] = pipe.generate([PROMPT], SamplingParams(max_tokens=2, ignore_eos=True), "ar",
                        on_text=lambda i, d: deltas.append(d))
    assert r.text == " \ufffd" and deltas == [" ", "\ufffd"]


def test_callbacks_of_the_wrong_arity_are_refused_before_any_work(smollm2_pipeline):
    """on_tokens gets a third argument with logprobs, a fourth on its first call with prompt_logprobs; on_finished
    and on_text two: one that cannot take them is an InvalidRequestError naming the call, before any token (the
    engine's own check, and the pipeline's for the callbacks it wraps)."""
    pipe = smollm2_pipeline
    called: list = []
    two, three = (lambda i, t: called.append(t)), (lambda i, t, lp: called.append(t))
    cases = [
        (dict(on_tokens=two), SamplingParams(max_tokens=2, logprobs=0),
         r"^on_tokens takes \(i, t\) but is called as on_tokens\(prompt_index, token_ids, logprobs\) for a request "
         r"with SamplingParams\.logprobs; define it to take 3 positional arguments, e\.g\. "
         r"def on_tokens\(prompt_index, token_ids, \*rest\)$"),
        (dict(on_tokens=three), SamplingParams(max_tokens=2, prompt_logprobs=0),
         r"called as on_tokens\(prompt_index, token_ids\) and on_tokens\(prompt_index, token_ids, logprobs, "
         r"prompt_logprobs\) on its first call, for a request with SamplingParams\.prompt_logprobs; define it to "
         r"take 2 and 4 positional arguments"),
        (dict(on_tokens=three), SamplingParams(max_tokens=2), r"called as on_tokens\(prompt_index, token_ids\);"),
        (dict(on_finished=lambda r: None), SamplingParams(max_tokens=2),
         r"^on_finished takes \(r\) but is called as on_finished\(prompt_index, result\);"),
        (dict(on_text=lambda d: None), SamplingParams(max_tokens=2),
         r"^on_text takes \(d\) but is called as on_text\(prompt_index, delta\);"),
        (dict(on_text="print"), SamplingParams(max_tokens=2), r"^on_text must be a function \(prompt_index, delta\)"),
    ]
    for kwargs, params, words in cases:
        with pytest.raises(InvalidRequestError, match=words):
            pipe.generate(["Hi"], params, **kwargs)
        if "on_text" not in kwargs:  # the engine's own check (Pipeline wraps on_finished)
            with pytest.raises(InvalidRequestError, match=words):
                pipe.engine.generate([pipe.encode("Hi")], params, **kwargs)
    assert called == []
    # a batch mixing requests with and without logprobs calls on_tokens with 2 and 3 arguments: *rest takes both
    got: list[int] = []
    results = pipe.generate(["Hi", "Hi"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, logprobs=0)],
                            on_tokens=lambda i, t, *rest: got.append(len(rest)))
    assert len(results) == 2 and sorted(set(got)) == [0, 1]
    with pytest.raises(InvalidRequestError, match="define it to take 2 and 3 positional arguments"):
        pipe.generate(["Hi", "Hi"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, logprobs=0)],
                      on_tokens=two)


def test_logits_keywords_reach_on_tokens_and_are_checked_before_any_work(smollm2_pipeline):
    """A request asking for generation / context logits gets them in on_tokens as the keywords `logits` /
    `context_logits` (also through the pipeline's on_text wrapper): a callback that cannot take them is refused
    before any token, and the streamed rows join to the result's."""
    pipe = smollm2_pipeline
    params = SamplingParams(max_tokens=6, ignore_eos=True, return_generation_logits=True, return_context_logits=True)
    with pytest.raises(InvalidRequestError, match=r"^on_tokens takes \(i, t\) but is called as on_tokens\(prompt_index, "
                                                  r"token_ids, context_logits=\.\.\., logits=\.\.\.\);.*\*\*logits\)$"):
        pipe.generate(["Hi"], params, on_tokens=lambda i, t: None, on_text=lambda i, d: None)
    rows, contexts, texts = [], [], []

    def on_tokens(i, t, logits=None, context_logits=None):
        rows.append(logits)
        contexts.append(context_logits)

    [result] = pipe.generate(["Hi"], params, on_text=lambda i, d: texts.append(d), on_tokens=on_tokens)
    assert torch.equal(torch.cat(rows), result.generation_logits) and rows[0].shape[1] == result.generation_logits.shape[1]
    assert contexts[0] is not None and torch.equal(contexts[0], result.context_logits)
    assert all(c is None for c in contexts[1:]) and "".join(texts) == result.text
