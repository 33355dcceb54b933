"""`dflash-trt serve --config FILE`: a trtllm-serve YAML config (the LLM API options a TensorRT-LLM deployment
gives trtllm-serve, as `dflash-trt build` writes trtllm/serve.yaml) read as serve's own options."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from dflash_trt.build.trtllm import serve_config
from dflash_trt.cli.trtllm_config import check_drafter, read_serve_config
from dflash_trt.errors import ConfigError
from dflash_trt.models.default import PACKAGED_DRAFTER
from tests.conftest import run_main
from tests.serve.test_openai_server import free_port
from tests.serve.test_serve_cli import stop_with_sigint, wait_until_healthy

LAYERS = [1, 8, 14, 20, 27]


def write(tmp_path, cfg: dict) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def bundle_config(**extra) -> dict:
    """What `dflash-trt build` writes for the default drafter (the build's own function), with `extra` merged in."""
    cfg = serve_config(1, 16, 16, LAYERS, "auto", max_batch_size=4)
    for key, value in extra.items():
        if isinstance(value, dict):
            cfg[key] = {**cfg.get(key, {}), **value}
        else:
            cfg[key] = value
    return cfg


def test_a_bundles_serve_yaml_becomes_serves_options(tmp_path):
    """The build's serve.yaml: tp, batch size, max_draft_len, the drafter (relative to the YAML's folder), the
    block reuse it turns off; mask token and layers kept to check the drafter; its executor knobs named as ignored."""
    path = write(tmp_path, bundle_config())
    options, checked, ignored = read_serve_config(path)
    assert options == {"tp_size": 1, "max_batch_size": 4, "max_draft_len": 15,
                       "drafter": str(tmp_path / "drafter"), "enable_prefix_caching": False}
    assert checked == {"speculative_config.decoding_type": "DFlash", "speculative_config.mask_token_id": 16,
                       "speculative_config.target_layer_ids": LAYERS}
    assert sorted(ignored) == ["disable_overlap_scheduler", "kv_cache_config.free_gpu_memory_fraction",
                               "speculative_config.attention_backend"]


def test_block_reuse_left_out_is_tensorrt_llms_default_prefix_caching_on(tmp_path):
    """KvCacheConfig.enable_block_reuse defaults to True in TensorRT-LLM: a config without the key serves with the
    prefix cache, one that sets it keeps its value."""
    cfg = bundle_config()
    del cfg["kv_cache_config"]["enable_block_reuse"]
    assert read_serve_config(write(tmp_path, cfg))[0]["enable_prefix_caching"] is True
    del cfg["kv_cache_config"]
    assert read_serve_config(write(tmp_path, cfg))[0]["enable_prefix_caching"] is True
    cfg["kv_cache_config"] = {"enable_block_reuse": True}
    assert read_serve_config(write(tmp_path, cfg))[0]["enable_prefix_caching"] is True


def test_max_seq_len_caps_a_requests_prompt_and_output(smollm2_pipeline, tmp_path):
    """max_seq_len (trtllm-serve's, `serve --max-seq-len`, `Engine.max_seq_len`): an output stops at the cap as at
    the target's context's end (finish_reason "length"), and a prompt that leaves no room is refused."""
    from dflash_trt.errors import PromptTooLongError
    from dflash_trt.runtime.sampling import SamplingParams

    assert read_serve_config(write(tmp_path, bundle_config(max_seq_len=4096)))[0]["max_seq_len"] == 4096
    engine = smollm2_pipeline.engine
    prompt = smollm2_pipeline.encode_chat("Write a long story about the sea.")
    try:
        engine.max_seq_len = len(prompt) + 5
        assert engine.context_len == len(prompt) + 5
        for mode in ("ar", "dflash"):
            [res] = engine.generate([prompt], SamplingParams(max_tokens=50, ignore_eos=True), mode)
            assert (len(res.token_ids), res.finish_reason) == (5, "length")
        engine.max_seq_len = len(prompt)
        with pytest.raises(PromptTooLongError, match=f"shorten it to at most {len(prompt) - 1} tokens"):
            engine.generate([prompt], SamplingParams(max_tokens=5), "ar")
        engine.max_seq_len = 10**6  # above the target's: the target's
        assert engine.context_len == engine.target.config.max_position_embeddings
    finally:
        engine.max_seq_len = None


def test_chunked_prefill_concurrency_and_dtype_map(tmp_path):
    path = write(tmp_path, bundle_config(enable_chunked_prefill=True, max_num_tokens=32, dtype="bfloat16",
                                         speculative_config={"max_concurrency": 2}))
    options, _, _ = read_serve_config(path)
    assert (options["prefill_chunk_size"], options["dtype"], options["max_concurrency"]) == (32, "bfloat16", "2")
    options, _, ignored = read_serve_config(write(tmp_path, bundle_config(enable_chunked_prefill=True, dtype="auto")))
    assert options["prefill_chunk_size"] == 8192 and "dtype" not in options  # TensorRT-LLM's default max_num_tokens
    options, _, ignored = read_serve_config(write(tmp_path, bundle_config(max_num_tokens=32)))
    assert "prefill_chunk_size" not in options and "max_num_tokens" in ignored  # no chunking: a batch bound only


@pytest.mark.parametrize("extra, message", [
    ({"max_input_len": 1024}, "does not implement max_input_len (serve accepts any prompt that leaves room"),
    ({"kv_cache_config": {"dtype": "fp8"}}, "kv_cache_config.dtype (serve keeps the KV cache in the model's dtype"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size (serve has no pipeline parallelism"),
    ({"max_batch_sizes": 4}, "max_batch_sizes"),  # not a TensorRT-LLM key: the schema check names it
    ({"max_batch_size": "four"}, "max_batch_size"),
    ({"speculative_config": {"decoding_type": "Eagle3"}}, "decoding_type is 'Eagle3'; dflash-trt serve speculates "
                                                          "with DFlash only"),
])
def test_what_serve_does_not_implement_is_refused_naming_the_key(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=None) as err:
        read_serve_config(write(tmp_path, bundle_config(**extra)))
    assert message in str(err.value) and str(tmp_path / "serve.yaml") in str(err.value)


def test_the_drafters_ids_may_be_left_to_its_config_as_tensorrt_llm_reads_them(tmp_path):
    cfg = bundle_config()
    del cfg["speculative_config"]["mask_token_id"], cfg["speculative_config"]["target_layer_ids"]
    options, checked, _ = read_serve_config(write(tmp_path, cfg))
    assert checked == {"speculative_config.decoding_type": "DFlash"} and options["max_draft_len"] == 15
    cfg["speculative_config"]["speculative_model_dir"] = cfg["speculative_config"].pop("speculative_model")
    assert read_serve_config(write(tmp_path, cfg))[0]["drafter"] == str(tmp_path / "drafter")  # the older name
    del cfg["speculative_config"]["speculative_model_dir"]
    with pytest.raises(ConfigError, match="speculative_config.speculative_model is required for DFlash"):
        read_serve_config(write(tmp_path, cfg))


@pytest.mark.parametrize("order", [("speculative_model", "speculative_model_dir"),
                                   ("speculative_model_dir", "speculative_model")])
def test_speculative_model_is_taken_over_speculative_model_dir_when_both_are_given(tmp_path, order):
    """TensorRT-LLM reads the drafter with AliasChoices("speculative_model", "speculative_model_dir"): given both, the
    first name's value, wherever the keys stand in the file (the later key had won, here the older name's)."""
    cfg = bundle_config()
    spec = cfg["speculative_config"]
    given = {"speculative_model": "new", "speculative_model_dir": "old"}
    spec.pop("speculative_model")
    cfg["speculative_config"] = {**spec, **{k: given[k] for k in order}}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert read_serve_config(path)[0]["drafter"] == str(tmp_path / "new")


def test_a_hub_id_as_speculative_model_is_named_as_one(tmp_path):
    """TensorRT-LLM downloads a Hub id given as speculative_model; here it was taken as a folder beside the YAML and
    refused as 'no such folder' at that path, the hint that --drafter OWNER/NAME gets lost."""
    cfg = bundle_config()
    cfg["speculative_config"]["speculative_model"] = "z-lab/Qwen3-8B-DFlash-b16"
    with pytest.raises(ConfigError, match="z-lab/Qwen3-8B-DFlash-b16 looks like a Hugging Face Hub id.*huggingface-cli "
                                          "download z-lab/Qwen3-8B-DFlash-b16"):
        read_serve_config(write(tmp_path, cfg))
    (tmp_path / "z-lab" / "Qwen3-8B-DFlash-b16").mkdir(parents=True)  # a folder of that name beside it: that folder
    assert read_serve_config(write(tmp_path, cfg))[0]["drafter"] == str(tmp_path / "z-lab" / "Qwen3-8B-DFlash-b16")


def test_neutral_values_of_refused_keys_are_taken(tmp_path):
    options, _, _ = read_serve_config(write(tmp_path, bundle_config(pipeline_parallel_size=1, enable_attention_dp=False)))
    assert options["max_batch_size"] == 4


def test_a_yaml_that_is_not_a_config_is_named(tmp_path):
    bad = tmp_path / "serve.yaml"
    for text, words in (("- a\n- b\n", "is a mapping of LLM API options, got list"), ("a: [\n", "cannot read it as YAML")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
            read_serve_config(bad)


def test_a_drafter_trained_otherwise_than_the_config_says_is_refused():
    checked = {"speculative_config.mask_token_id": 3, "speculative_config.target_layer_ids": LAYERS}
    check_drafter(checked, 3, tuple(LAYERS), Path("c.yaml"))  # the same: fine
    with pytest.raises(ConfigError, match=r"mask_token_id is 3, but the drafter was trained with 16"):
        check_drafter(checked, 16, tuple(LAYERS), Path("c.yaml"))
    with pytest.raises(ConfigError, match=r"target_layer_ids is \[1, 8, 14, 20, 27\], but the drafter was trained "
                                          r"with \[0, 1\]"):
        check_drafter(checked, 3, (0, 1), Path("c.yaml"))


def test_a_flag_that_disagrees_with_the_config_is_refused_before_the_models_load(monkeypatch, capsys, tmp_path):
    path = write(tmp_path, bundle_config())
    start = time.perf_counter()
    code, out, err = run_main(monkeypatch, capsys, "serve", "--config", str(path), "--max-batch-size", "5")
    assert code == 2 and f"--max-batch-size 5 disagrees with --config {path}, which sets it to 4; give one" in err
    code, out, err = run_main(monkeypatch, capsys, "serve", "--config", str(path), "--max-draft-len", "3")
    assert code == 2 and "--max-draft-len 3 disagrees" in err
    assert time.perf_counter() - start < 10
    code, out, err = run_main(monkeypatch, capsys, "serve", "--config", str(path), "--bundle", str(tmp_path))
    assert code == 2 and "names a drafter (speculative_config.speculative_model) and --bundle holds one" in err
    write(tmp_path, bundle_config(max_input_len=100))
    code, out, err = run_main(monkeypatch, capsys, "serve", "--config", str(path))
    assert code == 2 and "Invalid value for '--config'" in err and "does not implement max_input_len" in err


def test_a_tensor_parallel_size_from_the_config_is_named_as_its_key(monkeypatch, capsys, tmp_path):
    """tensor_parallel_size 3 in the YAML, one process: the torchrun line names the key and the file (it said
    "--tp-size 3", a flag the user had not given); 2 does not split the heads: named as the key too."""
    path = write(tmp_path, bundle_config(tensor_parallel_size=3))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, out, err = run_main(monkeypatch, capsys, "serve", "--config", str(path))
    assert (code, out) == (2, "") and " ".join(err.splitlines()[-1].split()) == (
        f"error: tensor_parallel_size 3 (in {path}) runs one process per rank: launch it with torchrun "
        "--nproc-per-node 3 $(which dflash-trt) ... --tp-size 3 (or pass --tp-size 1 to serve in one process) (see "
        "'dflash-trt serve --help')"), err
    path = write(tmp_path, bundle_config(tensor_parallel_size=2))
    code, out, err = run_main(monkeypatch, capsys, "serve", "--config", str(path))
    assert (code, out) == (1, "") and " ".join(err.splitlines()[-1].split()) == (
        f"error: tensor_parallel_size (in {path}) 2 does not divide the target's attention heads (9), KV heads (3); "
        f"use a tensor_parallel_size (in {path}) that divides them: 1, 3"), err


@pytest.mark.parametrize("extra, message", [
    ({"max_seq_len": 1}, "max_seq_len is 1: 1 is not in the range x>=2. (serve's --max-seq-len)"),
    ({"max_batch_size": 1000}, "max_batch_size is 1000: 1000 is not in the range 1<=x<=256. (serve's --max-batch-size)"),
    ({"enable_chunked_prefill": True, "max_num_tokens": 0}, "'max_num_tokens' must be >= 1"),
])
def test_a_config_value_out_of_serves_range_is_named_by_its_key(monkeypatch, capsys, tmp_path, extra, message):
    """A value TensorRT-LLM's schema takes but serve's option does not (max_seq_len 1, max_batch_size over 256) is
    refused as the config's key; it was 'Invalid value for --max-seq-len', a flag the user had not given."""
    path = write(tmp_path, bundle_config(**extra))
    code, out, err = run_main(monkeypatch, capsys, "serve", "--config", str(path))
    assert code == 2 and "Invalid value for '--config'" in err and message in " ".join(err.split()), err


@pytest.mark.slow
def test_serve_runs_with_a_trtllm_serve_config(tmp_path):
    """The real console script with a trtllm-serve config: the batch bound, chunked prefill and max_draft_len it sets
    are what the server runs with (GET /metrics, the answer's per-position counts), the answer the target's greedy one,
    the ignored knobs named on stderr."""
    from openai import OpenAI

    cfg = bundle_config(max_batch_size=3, enable_chunked_prefill=True, max_num_tokens=16, max_seq_len=128,
                        speculative_config={"max_draft_len": 7, "speculative_model": str(PACKAGED_DRAFTER)})
    path = write(tmp_path, cfg)
    beside = Path(sys.executable).parent / "dflash-trt"
    exe = str(beside) if beside.is_file() else shutil.which("dflash-trt")
    port = free_port()
    proc = subprocess.Popen([exe, "serve", "--config", str(path), "--port", str(port), "--served-model-name", "smol",
                             "--log-level", "warning", "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, base)
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "What is the capital "
                                                                                               "of France?"}],
                                           max_tokens=24, temperature=0)
        assert "Paris" in r.choices[0].message.content
        raw = httpx.post(base + "/v1/chat/completions", timeout=120, json={
            "model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
        assert len(raw.json()["choices"][0]["metrics"]["accepted_per_position"]) == 7  # max_draft_len 7
        stats = httpx.get(base + "/metrics").json()
        assert {s["maxNumActiveRequests"] for s in stats} == {3}
        assert httpx.get(base + "/v1/models").json()["data"][0]["max_model_len"] == 128  # max_seq_len
        long = httpx.post(base + "/v1/chat/completions", timeout=120, json={
            "model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 120})
        assert long.status_code == 400 and "> the server's max_seq_len of 128 tokens" in long.json()["error"]["message"]
        assert max(s["inflightBatchingStats"]["numCtxTokens"] for s in stats) == 16  # prompts read 16 at a time
    finally:
        err = stop_with_sigint(proc)
    assert proc.returncode == 0, err
    assert ("TensorRT-LLM's disable_overlap_scheduler, kv_cache_config.free_gpu_memory_fraction, "
            "speculative_config.attention_backend set its speed or GPU memory use, not its answers") in err


def test_a_max_seq_len_above_the_targets_context_is_refused(monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, "serve", "--max-seq-len", "100000", "--port", "0", "--threads", "1")
    assert code == 2 and "--max-seq-len 100000 is more than the target's context of 8192 tokens" in err


def test_mode_ar_with_a_config_does_not_warn_of_flags_the_user_did_not_give(monkeypatch, capsys, tmp_path):
    """--mode ar beside a config with a speculative_config: its max_draft_len is the config's, not a --max-draft-len
    the user gave, so no "only affects DFlash drafting" warning (the run then stops at --max-seq-len's check)."""
    cfg = bundle_config(speculative_config={"speculative_model": str(PACKAGED_DRAFTER)})
    path = write(tmp_path, cfg)
    code, out, err = run_main(monkeypatch, capsys, "serve", "--config", str(path), "--mode", "ar",
                              "--max-seq-len", "100000", "--port", "0", "--threads", "1")
    assert code == 2 and "--max-seq-len 100000 is more than" in err
    assert "only affect" not in err
    code, out, err = run_main(monkeypatch, capsys, "serve", "--config", str(path), "--mode", "ar", "--max-draft-len",
                              "15", "--max-seq-len", "100000", "--port", "0", "--threads", "1")
    assert code == 2 and "--max-draft-len only affects DFlash drafting" in err  # given on the command line: warned
