"""The usage example in `dflash_trt.api`'s module docstring runs as written (the README points to it)."""

from __future__ import annotations

import contextlib
import io
import textwrap

import dflash_trt.api


def docstring_example() -> str:
    """The indented code block of the module docstring, dedented."""
    lines = dflash_trt.api.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    "))
    end = next((i for i in range(start, len(lines)) if lines[i] and not lines[i].startswith("    ")), len(lines))
    return textwrap.dedent("\n".join(lines[start:end]))


def test_api_docstring_example_runs_and_answers():
    code = docstring_example()
    assert "load_pipeline()" in code and "SamplingParams" in code
    scope: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "dflash_trt/api.py docstring", "exec"), scope)  # noqa: S102 - our own docstring
    res = scope["res"]
    assert "Paris" in res.text
    assert 0 < len(res.token_ids) <= 32
    assert res.metrics.acceptance_length >= 1.0
    printed = out.getvalue()
    assert res.text in printed
    # the same request decoded autoregressively gives the same tokens (greedy, lossless)
    [ar] = scope["pipe"].generate([scope["prompt"]], scope["SamplingParams"](max_tokens=32), mode="ar")
    assert ar.token_ids == res.token_ids
    # a plain-text prompt (no chat template) is the same as its token ids; the stop string ends it
    code = scope["code"]
    pipe = scope["pipe"]
    assert "\n\n" not in code.text and (code.finish_reason, code.stop_reason) in (("stop", "\n\n"), ("length", None))
    [ids] = pipe.generate([pipe.encode("def fib(n):")], scope["SamplingParams"](max_tokens=32, stop=["\n\n"]))
    assert (ids.token_ids, ids.text) == (code.token_ids, code.text)


def test_pipeline_generate_takes_text_as_its_token_ids(smollm2_pipeline):
    """Pipeline.generate: a str item is its `encode` (no chat template), beside token id lists, and a single str is
    one prompt; text the tokenizer refuses is named."""
    import pytest

    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.runtime.sampling import SamplingParams

    pipe, params = smollm2_pipeline, SamplingParams(max_tokens=6, ignore_eos=True)
    chat = pipe.encode_chat("Hi")
    by_ids = pipe.generate([pipe.encode("The sea is"), chat], params)
    mixed = pipe.generate(["The sea is", chat], params)
    assert [r.token_ids for r in mixed] == [r.token_ids for r in by_ids]
    [one] = pipe.generate("The sea is", params)
    assert one.token_ids == by_ids[0].token_ids and one.text == by_ids[0].text
    with pytest.raises(InvalidRequestError, match="text holds an unpaired surrogate"):
        pipe.generate(["ok", "\ud800"], params)


def test_the_example_reads_as_written_in_the_source():
    """The module docstring is raw: the example copied from the file is the code that runs (a non-raw docstring
    turned the file's "\\\\n\\\\n" into the "\\n\\n" the test ran, while a copy kept the backslashes)."""
    from pathlib import Path

    assert dflash_trt.api.__doc__ in Path(dflash_trt.api.__file__).read_text()


def test_pipeline_takes_conversations_and_vllms_sampling_params_keyword(smollm2_pipeline):
    """encode_chat takes a list of messages (the text of one is the one-user-message list); generate takes
    sampling_params= (vLLM's name) for params, and names a sampling setting given as its own keyword."""
    import pytest

    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.runtime.sampling import SamplingParams

    pipe = smollm2_pipeline
    assert pipe.encode_chat([{"role": "user", "content": "Hi"}]) == pipe.encode_chat("Hi")
    talk = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]
    ids = pipe.encode_chat(talk)
    assert pipe.decode(ids).count("Be brief.") == 1 and pipe.decode(ids).endswith("Bye\nassistant\n")
    for bad, words in (([], "message is an empty list"), ([{"role": "robot", "content": "x"}], "message: message 1 has "
                                                                                                 "role 'robot'")):
        with pytest.raises(InvalidRequestError, match=words):
            pipe.encode_chat(bad)
    # any conversation, as OpenAI's chat API and the server take it: an empty user message either way, a system
    # prompt alone
    empty = pipe.encode_chat("")
    assert empty == pipe.encode_chat([{"role": "user", "content": ""}]) and pipe.decode(empty).endswith(
        "user\n\nassistant\n")
    assert pipe.decode(pipe.encode_chat([{"role": "system", "content": "Be brief."}])).endswith(
        "Be brief.\nassistant\n")
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    [a] = pipe.generate(["Hi"], sampling_params=params)
    [b] = pipe.generate(["Hi"], params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 3
    with pytest.raises(InvalidRequestError, match=r"^generate got both params and sampling_params \(the same argument "
                                                  r"by two names\); give one$"):
        pipe.generate(["Hi"], params, sampling_params=SamplingParams(max_tokens=5))
    with pytest.raises(InvalidRequestError, match=r"generate has no argument 'max_tokens'; give it in params: "
                                                  r"SamplingParams\(max_tokens=\.\.\.\)"):
        pipe.generate(["Hi"], max_tokens=4)
