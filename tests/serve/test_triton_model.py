"""The Triton Python-backend model on a real `tritonserver` (CPU), over Triton's own HTTP endpoints
(`/v2/models/NAME/generate`, `/generate_stream`): greedy output equal to the target's own, streaming
equal to the whole answer, errors that leave the server serving."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.serve.triton_repository import model_config, write_model_repository
from dflash_trt.serve.triton_tensors import INPUTS, OUTPUTS
from tests.serve.triton_server import TritonServer

QUESTION = "What is the capital of France? Answer in one sentence."


def test_model_config_names_every_tensor_and_parameter(tmp_path):
    folder = write_model_repository(tmp_path / "repo", "dflash", bundle="../..", mode="dflash")
    text = (folder / "config.pbtxt").read_text()
    assert text == model_config("dflash", {"bundle": "../..", "mode": "dflash"})
    assert "decoupled: true" in text and 'backend: "python"' in text
    assert "max_batch_size: 1\n" in text  # the TensorRT-LLM backend's shapes: [1, 1]
    for name, dtype, *_ in (*INPUTS, *OUTPUTS):
        assert f'name: "{name}" data_type: {dtype}' in text
    for name, dtype in (("repetition_penalty", "TYPE_FP32"), ("presence_penalty", "TYPE_FP32"),
                        ("frequency_penalty", "TYPE_FP32"), ("min_tokens", "TYPE_INT32"), ("min_length", "TYPE_INT32"),
                        ("min_p", "TYPE_FP32")):
        assert f'name: "{name}" data_type: {dtype} dims: [ 1 ] optional: true' in text  # the ensemble's names
    for name, dtype in (("guided_decoding_guide_type", "TYPE_STRING"), ("guided_decoding_guide", "TYPE_STRING")):
        assert f'name: "{name}" data_type: {dtype} dims: [ 1 ] optional: true' in text
    for name, dtype in (("embedding_bias_words", "TYPE_STRING"), ("embedding_bias_weights", "TYPE_FP32")):
        assert f'name: "{name}" data_type: {dtype} dims: [ -1 ] optional: true' in text
    # the TensorRT-LLM backend's inputs for what this model does not do, with its types and shapes
    for name, dtype, dims in (("lora_task_id", "TYPE_UINT64", "1"), ("lora_weights", "TYPE_FP16", "-1, -1"),
                              ("lora_config", "TYPE_INT32", "-1, 3"), ("prompt_embedding_table", "TYPE_FP16", "-1, -1"),
                              ("draft_input_ids", "TYPE_INT32", "-1"), ("decoder_text_input", "TYPE_STRING", "1"),
                              ("seed", "TYPE_UINT64", "1"), ("prompt_vocab_size", "TYPE_INT32", "1")):
        assert f'name: "{name}" data_type: {dtype} dims: [ {dims} ] optional: true' in text
    assert 'parameters { key: "bundle" value: { string_value: "../.." } }' in text
    assert "TritonPythonModel" in (folder / "1" / "model.py").read_text()
    with pytest.raises(ValueError, match="unknown Triton model parameter"):
        write_model_repository(tmp_path / "repo", "x", bundel="typo")


@pytest.mark.parametrize("params, words", [
    ({"mode": "beam"}, "'mode' must be one of dflash, ar (empty: dflash), got 'beam'"),
    ({"max_batch_sise": "2"}, "unknown Triton model parameter(s) ['max_batch_sise']"),
    ({"bundle": "/b", "target": "/t"}, "'bundle' and 'target' / 'drafter' exclude each other"),
    ({"max_batch_size": "0"}, "'max_batch_size' must be a whole number >= 1"),
    ({"enable_kv_cache_reuse": "yes"}, "'enable_kv_cache_reuse' must be true or false (empty: false), got 'yes'"),
    ({"enable_kv_cache_reuse": "true", "prefix_cache_gb": "0"}, "'prefix_cache_gb' must be a number of GiB >= 0.001"),
    ({"prefix_cache_gb": "0.0005"}, "'prefix_cache_gb' must be a number of GiB >= 0.001 (about 1 MiB; empty: 1), got "
                                    "'0.0005'"),
    ({"prefix_cache_gb": "lots"}, "'prefix_cache_gb' must be a number of GiB >= 0.001 (about 1 MiB; empty: 1), got "
                                  "'lots'"),
    ({"prefix_cache_gb": "nan"}, "got 'nan'"),
    ({"dtype": "float64"}, "'dtype' must be one of float32, bfloat16, float16, auto (empty: float32), got 'float64'"),
    ({"device": "gpu0"}, "'device' must be cpu, cuda, cuda:N or auto (empty: cpu), got 'gpu0'"),
    ({"device": "cpu:0"}, "'device' must be cpu, cuda, cuda:N or auto (empty: cpu), got 'cpu:0'"),
    ({"exclude_input_in_output": "1"}, "'exclude_input_in_output' must be true or false (empty: false), got '1'"),
    ({"EXECUTION_ENV_PATH": "env.tar.gz", "FORCE_CPU_ONLY_INPUT_TENSORS": "no", "mode": "x"}, "got 'x'"),  # theirs
])
def test_the_model_refuses_bad_parameters_before_loading(tmp_path, params, words):
    """Triton fails the model's load with the message (a bad `mode` used to load as READY, then every request
    waited forever; a misspelt parameter was ignored). Checked before any model loads: `bundle` names no folder."""
    import json as json_

    from dflash_trt.serve.triton import TritonPythonModel

    config = {"parameters": {k: {"string_value": v} for k, v in params.items()}}
    with pytest.raises(ValueError) as info:
        TritonPythonModel().initialize({"model_config": json_.dumps(config), "model_repository": str(tmp_path)})
    assert words in str(info.value)
    write_model_repository(tmp_path / "repo", "ok", EXECUTION_ENV_PATH="$$TRITON_MODEL_DIRECTORY/env.tar.gz", mode="ar")


def test_a_repository_from_an_older_version_loads_with_a_warning_naming_its_missing_inputs(tmp_path, capsys):
    """A config.pbtxt written before min_p and the embedding bias existed: the model names the inputs it lacks
    (requests cannot send them) and the fix, then loads as usual (here: fails on the bad mode, after the warning)."""
    from dflash_trt.serve.triton import TritonPythonModel
    from dflash_trt.serve.triton_repository import missing_inputs

    old = [{"name": name} for name, *_ in INPUTS if name not in ("min_p", "embedding_bias_words",
                                                                 "embedding_bias_weights")]
    assert missing_inputs({"input": old}) == ["min_p", "embedding_bias_words", "embedding_bias_weights"]
    assert missing_inputs({"input": [{"name": name} for name, *_ in INPUTS]}) == []
    config = {"input": old, "parameters": {"mode": {"string_value": "beam"}}}
    with pytest.raises(ValueError, match="'mode' must be one of"):
        TritonPythonModel().initialize({"model_config": json.dumps(config), "model_repository": str(tmp_path)})
    assert ("dflash-trt: warning: this model's config.pbtxt lacks the inputs ['min_p', 'embedding_bias_words', "
            "'embedding_bias_weights'] (written by an older dflash-trt)") in capsys.readouterr().err


def test_ensemble_inputs_at_their_defaults_pass_and_other_fields_are_refused():
    """Ensemble inputs this model does not have pass at the value that asks for what it does anyway; a typo, or such an input set otherwise
    (beam search, another end_id), is refused naming it."""
    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.serve.triton_tensors import check_extra_fields

    check_extra_fields({"id": "42", "pad_id": 7, "end_id": 2, "beam_width": 1, "num_return_sequences": 1,
                        "length_penalty": 1.0}, eos_token_ids=(2,))
    check_extra_fields({"prompt_table_extra_id": 9, "stop": False, "early_stopping": True,
                        "beam_search_diversity_rate": 0.5, "runtime_top_p_decay": 1.0, "runtime_top_p_min": 0.1,
                        "runtime_top_p_reset_ids": 3, "num_draft_tokens": 0, "use_draft_logits": False},
                       eos_token_ids=(2,))
    with pytest.raises(InvalidRequestError, match=r"unknown field\(s\) \['temprature'\]: this model's inputs are "):
        check_extra_fields({"temprature": 0.9}, eos_token_ids=(2,))
    for extra, words in (({"beam_width": 2}, "beam_width 2 asks for beam search (this model decodes one sequence per "
                                             "request), which this model does not do; send 1, or leave beam_width out"),
                         ({"beam_width": True}, "beam_width true asks for beam search"),
                         ({"end_id": 5}, "end_id 5 asks for an end token other than the target's EOS, which this model "
                                         "does not do; send the target's EOS id (2), or leave end_id out"),
                         ({"num_return_sequences": 2}, "num_return_sequences 2 asks for several sequences per request"),
                         ({"length_penalty": 1.2}, "length_penalty 1.2 asks for beam search's length penalty"),
                         ({"stop": True}, "stop true asks for cancelling the request with its request id (close the "
                                          "stream or cancel the gRPC call instead), which this model does not do; send "
                                          "false, or leave stop out"),
                         ({"runtime_top_p_decay": 0.9}, "runtime_top_p_decay 0.9 asks for top-p decay"),
                         ({"num_draft_tokens": 4}, "num_draft_tokens 4 asks for draft tokens from the tensorrt_llm_bls "
                                                   "model's draft model (this model drafts with its own drafter), which "
                                                   "this model does not do; send 0, or leave num_draft_tokens out"),
                         ({"use_draft_logits": True}, "use_draft_logits true asks for the tensorrt_llm_bls model's "
                                                      "draft-model logits")):
        with pytest.raises(InvalidRequestError) as info:
            check_extra_fields(extra, eos_token_ids=(2,))
        assert words in str(info.value) and "unknown" not in str(info.value), str(info.value)
    with pytest.raises(InvalidRequestError) as info:  # OpenAI's stop strings: this model's are stop_words
        check_extra_fields({"stop": "France"}, eos_token_ids=(2,))
    assert str(info.value).startswith('stop "France": this model\'s stop strings are stop_words (a list of strings: '
                                      '{"stop_words": [...]}')
    with pytest.raises(InvalidRequestError) as info:  # one error naming each
        check_extra_fields({"temprature": 0.9, "beam_width": 4}, eos_token_ids=(2,))
    assert "unknown field(s) ['temprature']" in str(info.value) and "; beam_width 4 asks for beam search" in str(info.value)


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    work = tmp_path_factory.mktemp("triton")
    # the embedded default model and drafter; one sequence at a time: a request left running would hold up the next;
    # prefix caching on (tensorrtllm_backend's parameter): the prompts repeated below reuse their K/V, with the
    # target's own tokens
    # exclude_input_in_output true (tensorrtllm_backend's parameter, as its quick start fills it in): text_output is
    # the answer alone unless a request says otherwise (the default false, the prompt first: test_bundle_triton.py)
    write_model_repository(work / "repo", "dflash", max_batch_size="1", enable_kv_cache_reuse="True",
                           prefix_cache_gb="0.25", exclude_input_in_output="true")
    server = TritonServer(work / "repo", work)
    yield server
    server.stop()


def generate(server, body, stream=False):
    """POST `body` to the model's /generate (or /generate_stream); the token counts are asked for unless the body
    says (the TensorRT-LLM backend's return_num_input_tokens / return_num_output_tokens)."""
    body = {"return_num_input_tokens": True, "return_num_output_tokens": True, **body}
    url = f"{server.url}/v2/models/dflash/generate{'_stream' if stream else ''}"
    r = httpx.post(url, json=body, timeout=300)
    if not stream:
        return r.status_code, r.json()
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    return r.status_code, events


class Characters:
    """A tokenizer whose tokens are characters (their code points), adding none of its own."""

    @staticmethod
    def encode(word, add_special_tokens=True):
        return [ord(c) for c in word]


def test_embedding_bias_sums_each_words_weight_over_its_tokens():
    """The TensorRT-LLM backend's embedding_bias_words / embedding_bias_weights as a logit bias: every token of a
    word gets its weight, words sharing a token add up, an empty word adds nothing; mistakes are refused by name."""
    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.serve.triton_tensors import embedding_bias

    encode = Characters()
    assert embedding_bias(None, None, encode) is None
    assert embedding_bias([b"ab", "b", ""], [1.5, -4.0, 99.0], encode) == {97: 1.5, 98: -2.5}
    for words, weights, message in (
            (["a"], None, "embedding_bias_words needs embedding_bias_weights beside it"),
            (None, [1.0], "embedding_bias_weights needs embedding_bias_words beside it"),
            (["a", "b"], [1.0], "embedding_bias_words has 2 word(s) and embedding_bias_weights 1 weight(s)"),
            (["a"], [float("nan")], "the weight of 'a' is nan; give a finite number"),
            (["aa"], [60.0], "the token 97 of 'aa' gets a bias of 120, outside [-100, 100]")):
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            embedding_bias(words, weights, encode)


def test_guide_type_and_guide_become_the_runtimes_guided_decoding():
    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.runtime.guided import GuidedDecoding
    from dflash_trt.serve.triton_tensors import guided_decoding

    assert guided_decoding(None, None) is None and guided_decoding(b"", b"") is None
    # "json": an object or an array, as TensorRT-LLM's guided decoder (XGrammar's builtin JSON grammar) takes it
    assert guided_decoding(b"json", None) == GuidedDecoding(json='{"type": ["object", "array"]}')
    assert guided_decoding(b"json_schema", b'{"type": "object"}') == GuidedDecoding(json='{"type": "object"}')
    assert guided_decoding("regex", "[0-9]+") == GuidedDecoding(regex="[0-9]+")
    assert guided_decoding(b"ebnf_grammar", b'root ::= "a"') == GuidedDecoding(grammar='root ::= "a"')
    for guide_type, guide, message in (
            (None, b"[0-9]", "guided_decoding_guide needs guided_decoding_guide_type beside it"),
            (b"xml", b"x", "guided_decoding_guide_type 'xml' is not one of json, json_schema, regex, ebnf_grammar"),
            (b"json", b"{}", 'for a schema use "json_schema"'),
            (b"regex", None, 'guided_decoding_guide_type "regex" needs guided_decoding_guide (the regex)')):
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            guided_decoding(guide_type, guide)


@pytest.mark.slow
@pytest.mark.parametrize("value, expected", [("8", 8), (" 12 ", 12), ("", None), ("0", "error"), ("-3", "error"),
                                             ("abc", "error"), ("1.5", "error"), ("\u00b2", "error"),
                                             ("\u0663", "error")])
def test_whole_number_parameters(value, expected):
    """config.pbtxt's max_batch_size / prefill_chunk_size: ASCII digits >= 1 (a superscript two or an Arabic-Indic
    three are digits to str.isdigit, not to a user)."""
    from dflash_trt.serve.triton_repository import whole_number_parameter

    if expected == "error":
        with pytest.raises(ValueError, match="'prefill_chunk_size' must be a whole number >= 1"):
            whole_number_parameter({"prefill_chunk_size": value}, "prefill_chunk_size", None)
    else:
        assert whole_number_parameter({"prefill_chunk_size": value}, "prefill_chunk_size", None) == expected


def test_greedy_generate_is_the_targets_output(triton, smollm2_pipeline):
    status, out = generate(triton, {"text_input": QUESTION, "apply_chat_template": True, "max_tokens": 40})
    assert status == 200, out
    [ref] = smollm2_pipeline.generate([smollm2_pipeline.encode_chat(QUESTION)], SamplingParams(max_tokens=40), mode="ar")
    assert out["text_output"] == ref.text
    assert out["finish_reason"] == ref.finish_reason and out["num_output_tokens"] == len(ref.token_ids)
    assert out["acceptance_length"] >= 1.0
    status, plain = generate(triton, {"text_input": "def fibonacci(n):", "max_tokens": 12})
    [ref] = smollm2_pipeline.generate([smollm2_pipeline.encode("def fibonacci(n):")], SamplingParams(max_tokens=12),
                                      mode="ar")
    assert plain["text_output"] == ref.text and plain["finish_reason"] == "length"


@pytest.mark.slow
def test_stream_adds_up_to_the_whole_answer_and_stop_words_end_it(triton):
    """Streamed deltas join into the whole answer; a stop word ends the output and stays in it, streamed or not, as
    the TensorRT-LLM backend returns it (its executor keeps the stop word's tokens; its postprocessing decodes them),
    where the OpenAI server cuts before it (test_openai_server.py). Matched on its tokens as written, as the backend's
    preprocessing tokenizes it: "of Fr" (tokens "of", " Fr") does not stop "... of France" (" of", " France"),
    " of France" does."""
    body = {"text_input": QUESTION, "apply_chat_template": True, "max_tokens": 40}
    _, whole = generate(triton, body)
    status, events = generate(triton, {**body, "stream": True}, stream=True)
    assert status == 200 and len(events) > 2
    assert "".join(e["text_output"] for e in events) == whole["text_output"]
    assert events[-1]["finish_reason"] == whole["finish_reason"]
    assert all("finish_reason" not in e for e in events[:-1])
    assert "of Fr" in whole["text_output"]
    _, text_only = generate(triton, {**body, "stop_words": ["of Fr"]})
    assert text_only["text_output"] == whole["text_output"] and text_only["finish_reason"] == whole["finish_reason"]
    stop = " of France"
    kept = whole["text_output"][: whole["text_output"].index(stop) + len(stop)]
    _, cut = generate(triton, {**body, "stop_words": [stop, "never said"]})
    assert cut["text_output"] == kept and cut["finish_reason"] == "stop"
    status, events = generate(triton, {**body, "stop_words": [stop], "stream": True}, stream=True)
    assert status == 200 and "".join(e["text_output"] for e in events) == kept
    assert events[-1]["finish_reason"] == "stop"
    assert sum(e["num_output_tokens"] for e in events) == cut["num_output_tokens"]  # each response counts its own


@pytest.mark.slow
def test_bad_requests_get_errors_and_the_model_keeps_serving(triton):
    cases = [({"text_input": "hi", "temperature": -1.0}, "temperature must be finite and >= 0"),
             ({"text_input": "hi", "max_tokens": 0}, "max_tokens must be >= 1"),
             ({"text_input": ""}, "text_input is empty"),
             ({"text_input": "hello " * 9000}, "shorten it to at most 8191"),
             ({"text_input": "hi", "temprature": 0.9}, "unknown field(s) ['temprature']: this model's inputs are "
                                                       "text_input, max_tokens"),
             ({"text_input": "hi", "max_tokens": 9000}, "max_tokens is 9000: 9001 > the target's context of 8192 "
                                                         "tokens; ask for at most 8191 tokens"),
             # the runtime's limit named as the input sent (it named the runtime's stop_token_sequences)
             ({"text_input": "hi", "stop_words": [f"w{i}" for i in range(1001)]},
              "stop_words holds 1001 words; give at most 1000")]
    for body, words in cases:
        status, out = generate(triton, body)
        assert status != 200 and words in out["error"], (body, out)
    status, out = generate(triton, {"text_input": "Hello", "max_tokens": 3})
    assert status == 200 and out["num_output_tokens"] == 3
    status, out = generate(triton, {"text_input": "Hello", "max_tokens": 3, "bad_words": "", "stop_words": ""})
    assert status == 200 and out["num_output_tokens"] == 3, out  # the TensorRT-LLM backend's example request


def test_text_that_is_not_utf8_is_refused_naming_the_input(triton):
    """Triton hands a STRING input's bytes over unchecked (here from a JSON string holding bytes that are not UTF-8):
    an error response names the input (it was Python's bare "'utf-8' codec can't decode byte 0xff ..."), and the
    model answers the next request."""
    url = f"{triton.url}/v2/models/dflash/generate"
    for body, words in ((b'{"text_input": "\xff\xfe", "max_tokens": 2}', "text_input is not UTF-8 text (byte 0: "),
                        (b'{"text_input": "hi", "max_tokens": 2, "stop_words": ["ok", "\xc3"]}', "stop_words is not UTF-8"),
                        (b'{"text_input": "hi", "max_tokens": 2, "bad_words": ["\xe2\x82"]}', "bad_words is not UTF-8"),
                        ((b'{"text_input": "hi", "max_tokens": 2, "guided_decoding_guide_type": "regex", '
                          b'"guided_decoding_guide": "a\xff"}'), "guided_decoding_guide is not UTF-8")):
        r = httpx.post(url, content=body, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"], (body, r.text)
    status, out = generate(triton, {"text_input": "h\u00e9llo \u65e5\u672c \U0001f389", "max_tokens": 2})
    assert status == 200 and out["num_output_tokens"] == 2, out


@pytest.mark.slow
def test_without_max_tokens_a_long_prompt_gets_the_room_it_leaves(triton, smollm2_pipeline):
    """max_tokens left out is 256, or the room the prompt leaves where that is less (as the OpenAI server's rule):
    a prompt 3 tokens short of the context was refused ("max_tokens is 256: ... ask for at most 3 tokens") although
    the request asked for no number of tokens."""
    prompt = "hello " * 8188
    room = smollm2_pipeline.engine.context_len - len(smollm2_pipeline.encode(prompt))
    assert 1 <= room < 256
    status, out = generate(triton, {"text_input": prompt})
    assert status == 200, out
    assert out["num_output_tokens"] == room and out["finish_reason"] == "length", out


#: a prompt the target continues for as long as it is let (greedy counting)
COUNTING = "1, 2, 3, 4, 5,"


@pytest.mark.slow
def test_a_client_that_leaves_a_stream_is_cancelled(triton):
    """A /generate_stream client that closes its connection after the first chunk: Triton marks the request
    cancelled, the model aborts it, and the next request (max_batch_size 1: it waits for a free row) is
    answered at once instead of after the 8,000 tokens the first one asked for."""
    body = {"text_input": COUNTING, "max_tokens": 8000, "stream": True}
    with httpx.stream("POST", f"{triton.url}/v2/models/dflash/generate_stream", json=body, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert "text_output" in json.loads(first[6:])
    r = httpx.post(f"{triton.url}/v2/models/dflash/generate", json={"text_input": "Hello", "max_tokens": 3,
                                                                     "return_num_output_tokens": True}, timeout=30)
    assert r.status_code == 200 and r.json()["num_output_tokens"] == 3



def as_list(value) -> list:
    """A Triton generate-endpoint output as a list (a one-element tensor comes back as a scalar)."""
    return value if isinstance(value, list) else [value]


@pytest.mark.slow
def test_return_log_probs_gives_the_targets_log_probs_streamed_or_not(triton, smollm2_pipeline):
    """return_log_probs (the TensorRT-LLM backend's tensors): output_log_probs per output token, the runtime's
    own values; cum_log_probs their sum; streamed, the responses' pieces add up to the whole."""
    body = {"text_input": "def fibonacci(n):", "max_tokens": 12, "return_log_probs": True}
    status, out = generate(triton, body)
    assert status == 200, out
    [ref] = smollm2_pipeline.generate([smollm2_pipeline.encode("def fibonacci(n):")],
                                      SamplingParams(max_tokens=12, logprobs=0), mode="ar")
    lps = as_list(out["output_log_probs"])
    assert len(lps) == out["num_output_tokens"] == 12
    assert lps == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-3)
    assert out["cum_log_probs"] == pytest.approx(sum(lps), abs=1e-3)
    status, events = generate(triton, {**body, "stream": True}, stream=True)
    assert status == 200
    streamed = [v for e in events if "output_log_probs" in e for v in as_list(e["output_log_probs"])]
    # the repeat reads its prompt's K/V from the prefix cache (the fixture's): float32 sums in another order, which
    # moved these values by up to 3.4e-6 on a 2-core VM
    assert streamed == pytest.approx(lps, abs=1e-5) and "cum_log_probs" in events[-1]
    _, plain = generate(triton, {"text_input": "def fibonacci(n):", "max_tokens": 4})
    assert "output_log_probs" not in plain and "cum_log_probs" not in plain


@pytest.mark.slow
def test_penalties_and_min_tokens_give_the_engines_tokens(triton, smollm2_pipeline):
    """repetition_penalty / presence_penalty / frequency_penalty (FP32) and min_tokens (INT32; min_length, its older
    TensorRT-LLM name, the same) reach the runtime: the answer is the engine's own with those SamplingParams."""
    import numpy as np

    prompt = "1, 2, 3, 4, 5,"
    ids = smollm2_pipeline.encode(prompt)
    penalties = {"repetition_penalty": 1.3, "presence_penalty": 1.5, "frequency_penalty": 1.0}
    status, out = generate(triton, {"text_input": prompt, "max_tokens": 12, **penalties})
    assert status == 200, out
    as_fp32 = {k: float(np.float32(v)) for k, v in penalties.items()}  # what Triton hands the model
    [ref] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=12, **as_fp32), mode="ar")
    [plain] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=12), mode="ar")
    assert out["text_output"] == ref.text != plain.text and out["num_output_tokens"] == len(ref.token_ids)
    question = "Reply with one word: yes or no. Is water wet?"  # answered in three tokens: "No." and EOS
    [ref] = smollm2_pipeline.generate([smollm2_pipeline.encode_chat(question)], SamplingParams(max_tokens=10,
                                                                                               min_tokens=6), mode="ar")
    for name in ("min_tokens", "min_length"):
        status, out = generate(triton, {"text_input": question, "apply_chat_template": True, "max_tokens": 10, name: 6})
        assert status == 200, out
        assert out["text_output"] == ref.text and out["num_output_tokens"] == len(ref.token_ids) >= 6, (name, out)
    status, out = generate(triton, {"text_input": "hi", "min_tokens": 2, "min_length": 3})
    assert status != 200 and "min_tokens (2) and min_length (3) differ" in out["error"]
    status, out = generate(triton, {"text_input": "hi", "max_tokens": 4, "min_tokens": 5})
    assert status != 200 and "min_tokens must be in [0, max_tokens = 4], got 5" in out["error"]
    status, out = generate(triton, {"text_input": "hi", "repetition_penalty": 0.0})
    assert status != 200 and "repetition_penalty must be finite and > 0" in out["error"]


@pytest.mark.slow
def test_min_p_and_embedding_bias_give_the_engines_tokens(triton, smollm2_pipeline):
    """min_p (FP32) and the TensorRT-LLM backend's embedding_bias_words / embedding_bias_weights reach the runtime:
    a word biased away changes the greedy answer to the engine's own with that logit_bias; min_p 1 at temperature 1
    keeps only the top token, so the sampled answer is the greedy one (without it, the same seed samples another)."""
    ids = smollm2_pipeline.encode_chat(QUESTION)
    body = {"text_input": QUESTION, "apply_chat_template": True, "max_tokens": 16}
    bias = {t: -100.0 for t in smollm2_pipeline.tokenizer.encode(" Paris", add_special_tokens=False)}
    [plain] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=16), mode="ar")
    [ref] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=16, logit_bias=bias), mode="ar")
    assert " Paris" in plain.text and " Paris" not in ref.text
    status, out = generate(triton, {**body, "embedding_bias_words": [" Paris"], "embedding_bias_weights": [-100.0]})
    assert status == 200, out
    assert out["text_output"] == ref.text and out["num_output_tokens"] == len(ref.token_ids)
    poem = "Write a short poem about the sea."
    [greedy] = smollm2_pipeline.generate([smollm2_pipeline.encode_chat(poem)], SamplingParams(max_tokens=16), mode="ar")
    sampled = {**body, "text_input": poem, "temperature": 1.0, "random_seed": 7}
    status, kept = generate(triton, {**sampled, "min_p": 1.0})
    assert status == 200 and kept["text_output"] == greedy.text, kept
    status, free = generate(triton, sampled)
    assert status == 200 and free["text_output"] != greedy.text, free
    status, out = generate(triton, {**body, "embedding_bias_words": [" Paris", "x"], "embedding_bias_weights": [1.0]})
    assert status != 200 and "embedding_bias_words has 2 word(s) and embedding_bias_weights 1 weight(s)" in out["error"]
    status, out = generate(triton, {**body, "min_p": 1.5})
    assert status != 200 and "min_p must be in [0, 1] (0 = off), got 1.5" in out["error"]


@pytest.mark.slow
def test_bad_words_give_the_engines_tokens(triton, smollm2_pipeline):
    """The TensorRT-LLM backend's bad_words (STRING [-1]): the answer is the engine's own with those words' token
    sequences banned, each tokenized as written as the backend's preprocessing does (`word_token_ids`) and matched
    where it may begin in the prompt; "" means none, as the backend's example request sends it."""
    ids = smollm2_pipeline.encode_chat(QUESTION)
    body = {"text_input": QUESTION, "apply_chat_template": True, "max_tokens": 16}
    words = [" Paris", " capital of"]  # as written: the words' tokens after a space, as they appear in the answer
    bad = [smollm2_pipeline.tokenizer.encode(w, add_special_tokens=False) for w in words]
    [ref] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=16, bad_words=bad, bad_words_read_prompt=True),
                                      mode="ar")
    [plain] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=16), mode="ar")
    assert " Paris" in plain.text and " Paris" not in ref.text
    status, out = generate(triton, {**body, "bad_words": words})
    assert status == 200 and out["text_output"] == ref.text, out
    status, out = generate(triton, {**body, "bad_words": ["Paris"]})  # "Paris" as written is not " Paris"
    assert status == 200 and out["text_output"] == plain.text, out
    status, out = generate(triton, {**body, "bad_words": ""})
    assert status == 200 and out["text_output"] == plain.text, out
    # a word beginning in the prompt (TensorRT-LLM's banBadWords reads the whole sequence): the chat prompt ends in
    # "\n", so "\nThe" bans the answer's first token, "The"
    newline_the = smollm2_pipeline.tokenizer.encode("\nThe", add_special_tokens=False)
    assert ids[-1] == newline_the[0] and plain.token_ids[0] == newline_the[1]
    [ref] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=16, bad_words=[newline_the],
                                                            bad_words_read_prompt=True), mode="ar")
    assert ref.token_ids[0] != plain.token_ids[0]
    status, out = generate(triton, {**body, "bad_words": ["\nThe"]})
    assert status == 200 and out["text_output"] == ref.text, out


@pytest.mark.slow
def test_guided_decoding_gives_the_engines_tokens(triton, smollm2_pipeline):
    """The TensorRT-LLM backend's guided_decoding_guide_type / guided_decoding_guide reach the runtime: the output is
    the engine's own under the same grammar, and a schema's output parses; a bad regex is an error response."""
    from dflash_trt.runtime.guided import GuidedDecoding

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    question = "What is the capital of France? Reply in JSON."
    ids = smollm2_pipeline.encode_chat(question)
    body = {"text_input": question, "apply_chat_template": True, "max_tokens": 24}
    for guide_type, guide, spec in (("json_schema", json.dumps(schema), GuidedDecoding(json=json.dumps(schema))),
                                    ("regex", "(Paris|Lyon)", GuidedDecoding(regex="(Paris|Lyon)"))):
        [ref] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=24, guided=spec), mode="ar")
        status, out = generate(triton, {**body, "guided_decoding_guide_type": guide_type, "guided_decoding_guide": guide})
        assert status == 200, out
        assert out["text_output"] == ref.text and out["num_output_tokens"] == len(ref.token_ids)
    assert out["text_output"] in ("Paris", "Lyon")  # the whole output matches the regex
    status, out = generate(triton, {**body, "guided_decoding_guide_type": "regex", "guided_decoding_guide": "(a"})
    assert status != 200 and "guided decoding: the regex does not compile" in out["error"]


@pytest.mark.slow
def test_guide_type_json_admits_an_array_as_tensorrt_llm(triton, smollm2_pipeline):
    """guided_decoding_guide_type "json" is any JSON object or array (TensorRT-LLM compiles it to XGrammar's builtin
    JSON grammar, whose root is either; tensorrtllm_backend's docs/guided_decoding.md answers this very prompt with
    "[2025]"): the answer is the engine's own under an object-or-array schema, here an array (it was an object only,
    "{}", OpenAI's json_object)."""
    from dflash_trt.runtime.guided import GuidedDecoding
    from dflash_trt.serve.triton_tensors import ANY_JSON_SCHEMA

    prompt = "What is the year after 2024? Answer:"
    [ref] = smollm2_pipeline.generate([smollm2_pipeline.encode(prompt)],
                                      SamplingParams(max_tokens=20, guided=GuidedDecoding(json=ANY_JSON_SCHEMA)), mode="ar")
    status, out = generate(triton, {"text_input": prompt, "max_tokens": 20, "guided_decoding_guide_type": "json"})
    assert status == 200, out
    assert out["text_output"] == ref.text == "[2024]" and out["finish_reason"] == "stop"
    assert json.loads(out["text_output"]) == [2024]


def test_kv_cache_reuse_parameters_give_the_engine_a_prefix_cache(tmp_path, smollm2_path):
    """`enable_kv_cache_reuse` / `prefix_cache_gb` (in-process: the model's initialize, then finalize)."""
    import json as json_

    from dflash_trt.serve.triton import TritonPythonModel

    for params, expected in (({"enable_kv_cache_reuse": "true", "prefix_cache_gb": "0.5"}, 2**29),
                             ({"enable_kv_cache_reuse": " TRUE "}, 2**30), ({"enable_kv_cache_reuse": "false"}, None),
                             ({}, None)):
        config = {"parameters": {k: {"string_value": v} for k, v in {"target": str(smollm2_path), **params}.items()}}
        model = TritonPythonModel()
        model.initialize({"model_config": json_.dumps(config), "model_repository": str(tmp_path)})
        try:
            cache = model.pipe.engine.prefix_cache
            assert (cache.max_bytes if cache is not None else None) == expected
        finally:
            model.finalize()


def test_relative_target_and_drafter_are_taken_from_the_models_folder(tmp_path, smollm2_path, monkeypatch):
    """`target` / `drafter` relative to the model's folder, as `bundle` is (they were taken from tritonserver's working
    directory, so a repository that names its models beside it loaded only when started from one folder)."""
    import json as json_

    from dflash_trt.models.default import default_drafter_path
    from dflash_trt.serve.triton import TritonPythonModel

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "target").symlink_to(smollm2_path)
    (tmp_path / "models" / "drafter").symlink_to(default_drafter_path())
    model_dir = tmp_path / "repo" / "dflash"
    model_dir.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "repo")  # where "../models/..." names nothing
    params = {"target": "../../models/target", "drafter": "../../models/drafter"}
    config = {"parameters": {k: {"string_value": v} for k, v in params.items()}}
    model = TritonPythonModel()
    model.initialize({"model_config": json_.dumps(config), "model_repository": str(model_dir)})
    try:
        assert model.pipe.target_path == smollm2_path.resolve()  # through the links
        assert model.pipe.drafter_path == default_drafter_path().resolve()
    finally:
        model.finalize()


def test_perf_metrics_place_the_request_on_the_wall_clock():
    """`perf_metrics`: the times from the arrival on (queue, then TTFT and the whole time from the prefill's start,
    in ns), the draft counts, and acceptance_rate 0 when nothing was drafted (as the TensorRT-LLM backend)."""
    from dflash_trt.runtime.stats import RequestMetrics
    from dflash_trt.serve.triton_tensors import PERF_OUTPUTS, perf_metrics

    m = RequestMetrics(prompt_tokens=9, completion_tokens=7, drafted_tokens=30, accepted_tokens=4, cached_tokens=5,
                       time_to_first_token_s=0.25, total_time_s=1.5)
    out = perf_metrics(m, queue_time_s=0.125, arrival_ns=10**18)
    assert out == {"arrival_time_ns": (10**18, "int64"), "first_scheduled_time_ns": (10**18 + 125_000_000, "int64"),
                   "first_token_time_ns": (10**18 + 375_000_000, "int64"),
                   "last_token_time_ns": (10**18 + 1_625_000_000, "int64"), "acceptance_rate": (4 / 30, "float32"),
                   "total_accepted_draft_tokens": (4, "int32"), "total_draft_tokens": (30, "int32"),
                   "cached_tokens": (5, "int32"),
                   # one token a block: 9 - 5 prompt positions read + 7 output positions written, 5 reused, 16 in all
                   "kv_cache_alloc_new_blocks": (11, "int32"), "kv_cache_reused_blocks": (5, "int32"),
                   "kv_cache_alloc_total_blocks": (16, "int32")}
    assert tuple(out) == PERF_OUTPUTS
    assert perf_metrics(RequestMetrics(completion_tokens=1), 0.0, 7)["acceptance_rate"] == (0.0, "float32")


@pytest.mark.slow
def test_return_perf_metrics_gives_the_requests_draft_counts_times_and_cached_tokens(triton):
    """return_perf_metrics (the TensorRT-LLM backend's input): the last response carries the request's draft counts,
    equal to the engine's own for the same prompt and settings (the model's: the CPU defaults), times on the wall
    clock in order within the request's span, and the prompt tokens the prefix cache gave (0, then all but the
    last on a repeat, with the same text)."""
    import time

    from dflash_trt.api import load_pipeline
    from dflash_trt.serve.triton_tensors import PERF_OUTPUTS

    prompt = "Zebra crossings in three sentences:"  # a first token no other request here starts with
    body = {"text_input": prompt, "max_tokens": 24, "return_perf_metrics": True}
    before = time.time_ns()
    status, out = generate(triton, body)
    after = time.time_ns()
    assert status == 200, out
    reference = load_pipeline(dtype="float32")  # the model's settings (its config.pbtxt sets none)
    ids = reference.encode(prompt)
    [ref] = reference.generate([ids], SamplingParams(max_tokens=24))
    assert out["text_output"] == ref.text
    assert out["total_draft_tokens"] == ref.metrics.drafted_tokens > 0
    assert out["total_accepted_draft_tokens"] == ref.metrics.accepted_tokens
    assert out["acceptance_rate"] == pytest.approx(ref.metrics.accepted_tokens / ref.metrics.drafted_tokens, abs=1e-6)
    times = [out[k] for k in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")]
    assert before <= times[0] <= times[1] <= times[2] <= times[3] <= after, times
    assert out["cached_tokens"] == 0
    status, events = generate(triton, {**body, "stream": True}, stream=True)
    assert status == 200
    assert [k for k in PERF_OUTPUTS if k in events[-1]] == list(PERF_OUTPUTS)
    assert not any(k in e for e in events[:-1] for k in PERF_OUTPUTS)
    assert "".join(e["text_output"] for e in events) == ref.text
    assert events[-1]["cached_tokens"] == len(ids) - 1  # the repeat reads all but its last token from the cache
    _, plain = generate(triton, {"text_input": prompt, "max_tokens": 4})
    assert not any(k in plain for k in PERF_OUTPUTS)


def test_a_gpu_that_is_not_there_is_named_as_the_parameter(tmp_path, monkeypatch):
    """device "cuda" on a machine whose torch sees no GPU (or cuda:N past the GPUs it sees) fails the load naming the
    config.pbtxt parameter, before any model loads (it named the CLI's --device, a flag Triton has not)."""
    import json as json_

    import torch

    from dflash_trt.errors import ConfigError
    from dflash_trt.serve.triton import TritonPythonModel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = {"parameters": {"device": {"string_value": "cuda"}, "bundle": {"string_value": "nowhere"}}}
    with pytest.raises(ConfigError) as info:
        TritonPythonModel().initialize({"model_config": json_.dumps(config), "model_repository": str(tmp_path)})
    assert str(info.value) == (f"config.pbtxt parameter 'device' cuda: torch sees no CUDA GPU here (torch "
                               f"{torch.__version__}); use cpu or run on a machine with a GPU")


def grpc_stream(server, requests: list[tuple[dict, list[str]]]):
    """Send `requests` ({input: numpy array}, requested outputs) on one gRPC stream (Triton's ModelStreamInfer, as
    the TensorRT-LLM backend's end_to_end_grpc_client.py does) and collect each one's results (or its error) until
    its final response."""
    import queue

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for i, (inputs, outputs) in enumerate(requests):
            tensors = []
            for name, value in inputs.items():
                t = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
                t.set_data_from_numpy(value)
                tensors.append(t)
            client.async_stream_infer("dflash", tensors, request_id=str(i), enable_empty_final_response=True,
                                      outputs=[grpcclient.InferRequestedOutput(o) for o in outputs])
        results: dict[str, list] = {str(i): [] for i in range(len(requests))}
        done: set[str] = set()
        while len(done) < len(requests):
            result, error = got.get(timeout=300)
            if error is not None:  # a refused request: its error, which names its id, is its only answer
                import re

                named = re.search(r"\[request id: ([^\]]+)\]", str(error))
                pending = [rid for rid in results if rid not in done]
                # Triton's own refusals name the request; an error response of the model does not: send such a
                # request alone
                assert named or len(pending) == 1, f"an error naming no request, with {pending} pending: {error}"
                rid = named.group(1) if named else pending[0]
                results[rid].append(error)
                done.add(rid)
                continue
            response = result.get_response()
            results[response.id].append(result)
            if response.parameters["triton_final_response"].bool_param:
                done.add(response.id)
        return [results[str(i)] for i in range(len(requests))]
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.slow
def test_the_tensorrt_llm_backends_grpc_requests_are_served_as_its_clients_read_them(triton, smollm2_pipeline):
    """The requests the TensorRT-LLM backend's end_to_end_grpc_client.py sends, on one gRPC stream: shapes [1, 1],
    beam_width / num_return_sequences / end_id / pad_id as tensors, exclude_input_in_output false, perf metrics with
    its kv_cache_*_blocks outputs; read as it reads them (`text_output[0].decode()`, numbers `[0][0]`). Whole: the
    prompt then the target's greedy answer; streamed: the answer's deltas; a request of 2 prompts ([2, 1]) and one
    without the batch dimension ([1]) are refused by Triton, naming the shape."""
    import numpy as np

    prompt = "def fibonacci(n):"
    [ref] = smollm2_pipeline.generate([smollm2_pipeline.encode(prompt)], SamplingParams(max_tokens=12), mode="ar")
    eos = smollm2_pipeline.engine.eos_token_ids[0]

    def request(stream: bool, batch=((prompt,),)):
        text = np.array([[p.encode() for p in row] for row in batch], dtype=object)
        n = len(batch)
        inputs = {"text_input": text, "max_tokens": np.full((n, 1), 12, np.int32),
                  "stream": np.full((n, 1), stream), "beam_width": np.ones((n, 1), np.int32),
                  "temperature": np.zeros((n, 1), np.float32), "num_return_sequences": np.ones((n, 1), np.int32),
                  "end_id": np.full((n, 1), eos, np.int32), "pad_id": np.full((n, 1), eos, np.int32),
                  "exclude_input_in_output": np.zeros((n, 1), bool), "return_perf_metrics": np.ones((n, 1), bool),
                  "return_num_input_tokens": np.ones((n, 1), bool), "return_num_output_tokens": np.ones((n, 1), bool)}
        return inputs, ["text_output", "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks",
                        "kv_cache_alloc_total_blocks", "total_draft_tokens", "arrival_time_ns", "num_input_tokens",
                        "num_output_tokens", "batch_index", "sequence_index"]

    # the backend's LoRA, prompt-tuning and external-draft inputs sent empty pass; a LoRA config is refused by name
    empty = {"lora_weights": np.zeros((1, 0, 0), np.float16), "lora_config": np.zeros((1, 0, 3), np.int32),
             "prompt_embedding_table": np.zeros((1, 0, 0), np.float16), "draft_input_ids": np.zeros((1, 0), np.int32)}
    lora = {"lora_config": np.array([[[0, 0, 8]]], np.int32), "draft_logits": np.ones((1, 2, 4), np.float32)}
    whole, streamed, two, flat, neutral = grpc_stream(triton, [
        request(False), request(True), request(False, ((prompt,), ("Once upon a time",))),
        ({"text_input": np.array([prompt.encode()], dtype=object)}, ["text_output"]),
        ({**request(False)[0], **empty}, ["text_output"])])
    [refused] = grpc_stream(triton, [({**request(False)[0], **lora}, ["text_output"])])
    [last] = whole
    assert last.as_numpy("text_output")[0].decode("utf-8") == prompt + ref.text  # exclude_input_in_output false
    assert last.as_numpy("kv_cache_alloc_total_blocks")[0][0] == len(smollm2_pipeline.encode(prompt)) + 12
    # the fixture's prefix cache may hold the prompt's start (an earlier test asked it): reused + new = total
    reused = last.as_numpy("kv_cache_reused_blocks")[0][0]
    assert 0 <= reused < len(smollm2_pipeline.encode(prompt))
    assert last.as_numpy("kv_cache_alloc_new_blocks")[0][0] + reused == last.as_numpy("kv_cache_alloc_total_blocks")[0][0]
    assert last.as_numpy("arrival_time_ns")[0][0] > 1.7e18
    # the backend's token counts, [1, 1] in every response: the whole answer's output_ids hold the prompt's tokens too
    n_prompt = len(smollm2_pipeline.encode(prompt))
    assert last.as_numpy("num_input_tokens").tolist() == [[n_prompt]]
    assert last.as_numpy("num_output_tokens").tolist() == [[n_prompt + 12]]
    assert last.as_numpy("batch_index") is None and last.as_numpy("sequence_index") is None  # one prompt, one sequence
    assert all(r.as_numpy("num_input_tokens").tolist() == [[n_prompt]] for r in streamed)
    assert sum(r.as_numpy("num_output_tokens")[0][0] for r in streamed) == 12  # streamed: the new tokens only
    # streamed: only the answer (the backend streams new tokens only), its deltas joined
    texts = [r.as_numpy("text_output")[0].decode("utf-8") for r in streamed if r.as_numpy("text_output") is not None]
    assert "".join(texts) == ref.text and len(texts) > 1
    assert "batch-size must be <= 1" in str(two[0])
    assert "Expected [-1,1], got [1]" in str(flat[0])
    assert neutral[-1].as_numpy("text_output")[0].decode("utf-8") == prompt + ref.text
    assert ("this model does not support lora_config: LoRA adapters; draft_logits: drafts from outside (this model "
            "drafts with its own drafter)") in str(refused[0])


def test_docs_list_exactly_the_declared_tensors(tmp_path):
    """docs/triton.md's tables hold exactly the inputs and outputs the written config.pbtxt declares (names, types,
    dims, in order), and the module docstring names each of them."""
    from pathlib import Path

    import dflash_trt.serve.triton_tensors as tensors_module

    text = (write_model_repository(tmp_path / "repo", "dflash") / "config.pbtxt").read_text()
    declared = {kind: re.findall(r'\{ name: "(\w+)" data_type: TYPE_(\w+) dims: \[ ([-0-9, ]+) \]',
                                 text.split(f"{kind} [\n")[1].split("\n]")[0]) for kind in ("input", "output")}
    docs = (Path(__file__).parents[2] / "docs" / "triton.md").read_text()
    for kind in ("input", "output"):
        table = docs.split(f"| {kind} | type | dims | |")[1].split("\n\n")[0]
        rows = re.findall(r"^\| `(\w+)` \| (\w+) \| \[([-0-9, ]+)\] \|", table, re.M)
        assert rows == [(n, t, d.strip()) for n, t, d in declared[kind]], kind
    assert len(declared["input"]) == len(INPUTS) and len(declared["output"]) == len(OUTPUTS)
    undocumented = [name for name, *_ in (*INPUTS, *OUTPUTS)
                    if not re.search(rf"(?<![\w]){name}(?![\w])", tensors_module.__doc__)]
    assert undocumented == []


def test_token_counts_are_the_backends():
    """num_input_tokens: the prompt's; num_output_tokens: the response's own tokens, the prompt's too where its
    text_output starts with the prompt (the backend's output_ids hold them); each only where asked for."""
    from dflash_trt.serve.triton_tensors import token_counts

    assert token_counts(7, 3, False, True, True) == {"num_input_tokens": 7, "num_output_tokens": 3}
    assert token_counts(7, 3, True, False, True) == {"num_output_tokens": 10}
    assert token_counts(7, 0, False, True, False) == {"num_input_tokens": 7}
    assert token_counts(7, 3, False, False, False) == {}


@pytest.mark.slow
def test_token_counts_over_http_streamed_or_not(triton, smollm2_pipeline):
    """return_num_input_tokens / return_num_output_tokens over /generate and /generate_stream (they were refused as
    unknown fields): every response carries the prompt's count and its own output tokens' count, which add up to the
    output's; a whole answer that starts with the prompt counts its tokens too; neither is sent unless asked."""
    prompt = "def fibonacci(n):"
    ids = smollm2_pipeline.encode(prompt)
    [ref] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=10), mode="ar")
    status, out = generate(triton, {"text_input": prompt, "max_tokens": 4, "return_num_input_tokens": True,
                                    "return_num_output_tokens": False})
    assert status == 200 and out["num_input_tokens"] == len(ids) and "num_output_tokens" not in out, out
    body = {"text_input": prompt, "max_tokens": 10, "return_num_input_tokens": True, "return_num_output_tokens": True}
    status, out = generate(triton, body)
    assert status == 200 and out["text_output"] == ref.text, out
    assert out["num_input_tokens"] == len(ids) and out["num_output_tokens"] == len(ref.token_ids) == 10
    status, events = generate(triton, {**body, "stream": True}, stream=True)
    assert status == 200 and len(events) > 2 and "".join(e["text_output"] for e in events) == ref.text
    assert all(e["num_input_tokens"] == len(ids) for e in events)
    assert sum(e["num_output_tokens"] for e in events) == 10 and all(e["num_output_tokens"] >= 0 for e in events)
    status, out = generate(triton, {**body, "exclude_input_in_output": False})
    assert out["text_output"] == prompt + ref.text and out["num_output_tokens"] == len(ids) + 10, out
    status, out = generate(triton, {"text_input": prompt, "max_tokens": 4, "return_num_input_tokens": False,
                                    "return_num_output_tokens": False})
    assert status == 200 and not {"num_input_tokens", "num_output_tokens", "batch_index", "sequence_index"} & set(out)
    # the tensorrt_llm model's inputs now declared: a value is refused naming it and why; neutral ones pass
    status, out = generate(triton, {"text_input": "hi", "max_tokens": 2, "draft_acceptance_threshold": 0.5})
    assert status == 400 and ("this model does not support draft_acceptance_threshold: drafts from outside (this model "
                              "drafts with its own drafter)") in out["error"], out
    status, out = generate(triton, {"text_input": "hi", "max_tokens": 2, "runtime_top_k": 5})
    assert status == 400 and "runtime_top_k: the tensorrt_llm model's token-level input (this model takes the " \
                             "ensemble's: send top_k)" in out["error"], out
    status, out = generate(triton, {"text_input": "hi", "max_tokens": 2, "stop": True})
    assert status == 400 and "stop true asks for cancelling the request with its request id" in out["error"], out
    status, out = generate(triton, {"text_input": "hi", "max_tokens": 2, "prompt_table_extra_id": 4, "stop": False,
                                    "runtime_top_p_decay": 1.0, "early_stopping": True})
    assert status == 200 and out["num_output_tokens"] == 2, out


def test_unsupported_backend_inputs_pass_only_empty():
    """The TensorRT-LLM backend's LoRA / prompt-tuning / external-draft / decoder-prompt inputs: empty tensors (no
    element, or empty strings) ask for nothing and pass; a value is refused naming each input and what it asks for;
    lora_task_id names an adapter whatever its value (0 too)."""
    import numpy as np

    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.serve.triton_tensors import check_unsupported_inputs

    check_unsupported_inputs({"lora_task_id": None, "lora_weights": np.zeros((1, 0, 0), np.float16),
                              "lora_config": np.zeros((1, 0, 3), np.int32), "draft_input_ids": np.zeros((1, 0)),
                              "decoder_text_input": np.array([[b""]], dtype=object)})
    with pytest.raises(InvalidRequestError) as info:
        check_unsupported_inputs({"lora_task_id": np.array([[0]], np.uint64), "lora_weights": None,
                                  "draft_input_ids": np.array([[5, 6]], np.int32)})
    assert str(info.value) == ("this model does not support lora_task_id: LoRA adapters; draft_input_ids: drafts from "
                               "outside (this model drafts with its own drafter) (the TensorRT-LLM backend's inputs); "
                               "leave lora_task_id, draft_input_ids out, or send them empty")
    with pytest.raises(InvalidRequestError, match="decoder_text_input: encoder-decoder targets"):
        check_unsupported_inputs({"decoder_text_input": np.array([[b"hi"]], dtype=object)})


def test_words_are_tokenized_as_the_backends_preprocessing_does(smollm2_pipeline):
    """stop_words / bad_words: each word's tokens as written, without special tokens or an added space (the backend's
    `_to_word_list_format`), a word of no tokens left out; an image of the BLS model is refused by name."""
    import numpy as np

    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.serve.triton_tensors import check_unsupported_inputs, word_token_ids

    tok = smollm2_pipeline.tokenizer

    def encode(word):
        return tok.encode(word, add_special_tokens=False)

    assert word_token_ids(["of Fr", " of France", ""], tok, "stop_words") == (tuple(encode("of Fr")), tuple(encode(" of France")))
    assert encode("of Fr")[0] != encode(" of France")[0]  # "of" is not " of": "of Fr" cannot stop "... of France"
    for name in ("stop_words", "bad_words"):  # the runtime's limit, named as the input the request sent
        assert len(word_token_ids([f"w{i}" for i in range(1000)], tok, name)) == 1000
        with pytest.raises(InvalidRequestError, match=f"^{name} holds 1001 words; give at most 1000$"):
            word_token_ids([f"w{i}" for i in range(1001)], tok, name)
    check_unsupported_inputs({"image_url_input": np.array([[b""]], dtype=object),
                              "image_bytes_input": np.zeros((1, 0, 0, 0, 0), np.uint8)})
    with pytest.raises(InvalidRequestError, match=re.escape("image_url_input: multimodal targets (the tensorrt_llm_bls "
                                                            "model's images and videos)")):
        check_unsupported_inputs({"image_url_input": np.array([[b"http://x/cat.png"]], dtype=object)})


def test_words_with_a_tokenizer_that_adds_a_bos_are_tokenized_as_the_backends_preprocessing_does(smollm2_path):
    """SmolLM2's tokenizer made to add its BOS (<|im_start|>, 1), as a Llama tokenizer adds one: the backend's
    `_get_embedding_bias` tokenizes each embedding-bias word with `encode(word)` (special tokens on), so the BOS gets
    every word's weight, an empty word's too; its `_to_word_list_format` tokenizes stop and bad words without them.
    SmolLM2's own tokenizer adds none: the words' tokens alone."""
    from transformers import AutoTokenizer

    from dflash_trt.serve.triton_tensors import embedding_bias, word_token_ids

    plain = AutoTokenizer.from_pretrained(smollm2_path)
    with_bos = AutoTokenizer.from_pretrained(smollm2_path, add_bos_token=True)
    paris, france = plain.encode(" Paris"), plain.encode(" France")
    assert len(paris) == len(france) == 1 and with_bos.encode(" Paris") == [1, *paris]
    assert embedding_bias([" Paris", " France", ""], [-5.0, 2.0, 0.5], with_bos) == {1: -2.5, paris[0]: -5.0,
                                                                                     france[0]: 2.0}
    assert embedding_bias([" Paris", " France", ""], [-5.0, 2.0, 0.5], plain) == {paris[0]: -5.0, france[0]: 2.0}
    assert word_token_ids([" Paris", " of France"], with_bos, "bad_words") == word_token_ids(
        [" Paris", " of France"], plain, "bad_words") == (tuple(paris), tuple(plain.encode(" of France")))


def test_logits_outputs_have_the_backends_shapes():
    import torch

    from dflash_trt.serve.triton_tensors import logits_outputs

    out = logits_outputs(torch.ones(5, 7), torch.zeros(3, 7))
    assert out["context_logits"].shape == (1, 5, 7) and out["generation_logits"].shape == (1, 1, 3, 7)
    # streamed: the executor's token-major slice [tokens, beam, V] with the backend's batch dimension before it
    assert logits_outputs(None, torch.zeros(2, 7), streamed=True)["generation_logits"].shape == (1, 2, 1, 7)
    assert out["context_logits"].dtype == out["generation_logits"].dtype == "float32"
    assert logits_outputs(None, None) == {} and logits_outputs(None, torch.zeros(0, 0)) == {}


@pytest.mark.slow
def test_logits_stop_and_bls_inputs_over_http(triton, smollm2_pipeline):
    """return_context_logits / return_generation_logits: the target's logits, those of one forward over the prompt
    and the output (the engine's own prefill of them, float32), whole or streamed (the prompt's in every response,
    each token's in the response with its text, adding up to the whole answer's);
    "stop": [...] gets Triton's own 400 as the ensemble's /generate does ("stop" is no input of either), a string
    is told to go in stop_words; the BLS model's num_draft_tokens 0 passes."""
    import numpy as np
    import torch

    prompt = "def fibonacci(n):"
    ids = smollm2_pipeline.encode(prompt)
    [ref] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=6, return_context_logits=True), mode="ar")
    [full] = smollm2_pipeline.generate([ids + ref.token_ids], SamplingParams(max_tokens=1, return_context_logits=True),
                                       mode="ar")
    reference = full.context_logits  # [prompt + output, V]: one forward over both
    n = len(ids)
    body = {"text_input": prompt, "max_tokens": 6, "return_context_logits": True, "return_generation_logits": True,
            "num_draft_tokens": 0, "use_draft_logits": False}
    status, out = generate(triton, body)
    assert status == 200 and out["text_output"] == ref.text, out
    # Triton's generate endpoint gives a tensor's values flat (the shapes, [1, n, V] and [1, 1, 6, V], go to gRPC
    # clients: test_logits_outputs_have_the_backends_shapes)
    vocab = reference.shape[1]
    context, generation = np.array(out["context_logits"], np.float32), np.array(out["generation_logits"], np.float32)
    assert context.shape == (n * vocab,) and generation.shape == (6 * vocab,)
    context, generation = context.reshape(1, n, vocab), generation.reshape(1, 1, 6, vocab)
    torch.testing.assert_close(torch.from_numpy(context[0]), reference[:n], atol=2e-3, rtol=0)
    torch.testing.assert_close(torch.from_numpy(generation[0, 0]), reference[n - 1 : -1], atol=2e-3, rtol=0)
    # streamed as the backend's executor streams them: the prompt's logits in every response, each token's in the
    # response with its text (here one token a response: SmolLM2's tokens are whole characters)
    status, events = generate(triton, {**body, "stream": True}, stream=True)
    assert status == 200 and "".join(e["text_output"] for e in events) == ref.text
    for e in events:
        np.testing.assert_allclose(np.array(e["context_logits"], np.float32), context.reshape(-1), atol=1e-5, rtol=0)
    slices = [np.array(e["generation_logits"], np.float32).reshape(-1, vocab) for e in events if "generation_logits" in e]
    assert len(slices) > 1 and sum(map(len, slices)) == 6 and [len(s) for s in slices] == [
        e["num_output_tokens"] for e in events if "generation_logits" in e]
    torch.testing.assert_close(torch.from_numpy(np.concatenate(slices)), torch.from_numpy(generation[0, 0]),
                               atol=2e-3, rtol=0)
    _, plain = generate(triton, {"text_input": prompt, "max_tokens": 2})
    assert "context_logits" not in plain and "generation_logits" not in plain
    status, out = generate(triton, {"text_input": prompt, "max_tokens": 2, "stop": ["\n"]})
    assert status == 400 and out["error"] == ("parameter 'stop' has invalid type. It should be either 'int', 'bool', "
                                              "or 'string'."), out
    status, out = generate(triton, {"text_input": prompt, "max_tokens": 2, "stop": "\n"})
    assert status == 400 and "this model's stop strings are stop_words" in out["error"], out
    status, out = generate(triton, {"text_input": prompt, "max_tokens": 2, "num_draft_tokens": 3})
    assert status == 400 and "num_draft_tokens 3 asks for draft tokens" in out["error"], out


def test_seed_is_random_seeds_newer_name():
    from dflash_trt.errors import InvalidRequestError
    from dflash_trt.serve.triton_tensors import renamed_input

    assert renamed_input("seed", None, "random_seed", None) is None
    assert renamed_input("seed", 7, "random_seed", None) == renamed_input("seed", None, "random_seed", 7) == 7
    assert renamed_input("seed", 7, "random_seed", 7) == 7
    with pytest.raises(InvalidRequestError, match=re.escape("seed (7) and random_seed (8) differ; they are the same "
                                                            "input (random_seed its older name): give one of them")):
        renamed_input("seed", 7, "random_seed", 8)


@pytest.mark.parametrize("device, dtype, stored, cuda, expected", [
    ("auto", "auto", "bfloat16", True, ("cuda", "bfloat16", None)),  # a bundle on a GPU machine: its dtype
    ("auto", "auto", "float16", True, ("cuda", "float16", None)),
    ("auto", "auto", None, True, ("cuda", "bfloat16", None)),  # a config.json naming no dtype
    ("auto", "auto", "float8_e4m3fn", True, ("cuda", "bfloat16", None)),  # one the runtime does not run in
    ("auto", "auto", "bfloat16", False, ("cpu", "float32", "config.pbtxt parameter 'device' auto: torch sees no CUDA "
                                                           "GPU here, so the model runs on the CPU in float32")),
    ("auto", "bfloat16", "bfloat16", False, ("cpu", "bfloat16", "config.pbtxt parameter 'device' auto: torch sees no "
                                                                "CUDA GPU here, so the model runs on the CPU")),
    ("cuda:1", "auto", "float32", True, ("cuda:1", "float32", None)),
    ("", "auto", "bfloat16", True, ("cpu", "float32", None)),  # device empty: the CPU, whatever the machine
    ("", "", "bfloat16", True, ("cpu", "float32", None)),
])
def test_auto_device_and_dtype(device, dtype, stored, cuda, expected):
    from dflash_trt.serve.triton_repository import auto_device_dtype

    assert auto_device_dtype(device, dtype, stored, cuda) == expected


@pytest.mark.slow
def test_unsupported_inputs_seed_and_exclude_input_over_http(triton, smollm2_pipeline):
    """Over /generate: lora_task_id is an error response naming LoRA (it was Triton's "unexpected inference input"), and
    the model serves on; `seed` samples as `random_seed` does; exclude_input_in_output false puts the prompt first in a
    whole answer, and not in a streamed one (the backend streams new tokens only)."""
    status, out = generate(triton, {"text_input": "hi", "max_tokens": 2, "lora_task_id": 3})
    assert status == 400 and ("this model does not support lora_task_id: LoRA adapters (the TensorRT-LLM backend's "
                              "input); leave lora_task_id out, or send it empty") in out["error"], out
    status, out = generate(triton, {"text_input": "hi", "max_tokens": 2, "decoder_text_input": "", "prompt_vocab_size": 0})
    assert status == 200 and out["num_output_tokens"] == 2, out
    sampled = {"text_input": "Write a short poem about the sea.", "max_tokens": 12, "temperature": 1.0}
    _, old = generate(triton, {**sampled, "random_seed": 11})
    _, new = generate(triton, {**sampled, "seed": 11})
    assert new["text_output"] == old["text_output"], (old, new)
    status, out = generate(triton, {**sampled, "seed": 11, "random_seed": 12})
    assert status != 200 and "seed (11) and random_seed (12) differ" in out["error"]
    prompt = "def fibonacci(n):"
    [ref] = smollm2_pipeline.generate([smollm2_pipeline.encode(prompt)], SamplingParams(max_tokens=8), mode="ar")
    _, out = generate(triton, {"text_input": prompt, "max_tokens": 8, "exclude_input_in_output": False})
    assert out["text_output"] == prompt + ref.text
    _, events = generate(triton, {"text_input": prompt, "max_tokens": 8, "exclude_input_in_output": False,
                                  "stream": True}, stream=True)
    assert "".join(e["text_output"] for e in events) == ref.text
