"""Tensor parallelism over processes (gloo on this CPU): every rank decodes the same tokens, greedy DFlash
equals greedy autoregressive output under tp exactly, and the sharded target's logits match the unsharded
one's to float rounding."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_trt.errors import ConfigError
from tests.runtime.tp_worker import guided_params, penalized_params, run_rank


def run_tp(tmp_path, world, target, drafter, prompts, max_tokens):
    import torch.multiprocessing as mp

    mp.start_processes(run_rank, args=(world, str(tmp_path / "init"), str(target), str(drafter), prompts, max_tokens,
                                       str(tmp_path)), nprocs=world, start_method="spawn")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def reference(target, drafter, prompts, max_tokens):
    from dflash_trt.api import load_pipeline
    from dflash_trt.runtime.sampling import SamplingParams

    pipe = load_pipeline(str(target), str(drafter), "float32", draft_confidence=0.0, tree_topk=1, prompt_lookup=0,
                         max_concurrency=None)
    [res] = pipe.generate([prompts[0]], SamplingParams(max_tokens=max_tokens), mode="ar")
    cache = pipe.engine.target.new_cache(1, 64)
    with torch.inference_mode():
        ids = torch.tensor([prompts[0]])
        logits = pipe.engine.target(ids, torch.arange(ids.shape[1])[None], cache, ids.shape[1]).logits[0, -1]
    return res.token_ids, logits


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, smollm2_path):
    from tests.build.build_helpers import QWEN3_TINY, write_tiny_drafter, write_tiny_target

    root = tmp_path_factory.mktemp("tp-qwen3")
    target = write_tiny_target(root / "target", smollm2_path, model_type="qwen3", **QWEN3_TINY)
    return target, write_tiny_drafter(root / "drafter", target)


def test_tp2_qwen3_ranks_agree_and_match_one_process(tmp_path, tiny_qwen3):
    prompts = [[1, 520, 3011, 44, 7], [9, 8, 7]]
    # 100 tokens: past the KV caches' first size (prompt + 64 + a block), so every rank grows them alike
    ranks = run_tp(tmp_path, 2, *tiny_qwen3, prompts, 100)
    assert ranks[0] == {**ranks[1], "logits": ranks[0]["logits"]} and ranks[0]["logits"] == ranks[1]["logits"]
    assert ranks[0]["kv_heads"] == 1  # 2 KV heads over 2 ranks
    assert ranks[0]["dflash"] == ranks[0]["ar"]  # lossless under tp, token for token
    assert max(len(t) for t in ranks[0]["ar"]) > 64 + 8
    ref_tokens, ref_logits = reference(*tiny_qwen3, prompts, 100)
    assert ranks[0]["ar"][0] == ref_tokens
    torch.testing.assert_close(torch.tensor(ranks[0]["logits"]), ref_logits, rtol=0, atol=1e-4)


def test_tp2_qwen2_with_biases_and_a_sliding_window_matches_one_process(tmp_path, smollm2_path):
    """Qwen2's q/k/v biases split with their heads (o_proj has none), and its last two layers slide (a window of 4
    positions, shorter than prompt + answer): every rank decodes what one process does."""
    from tests.build.build_helpers import QWEN3_TINY, write_tiny_drafter, write_tiny_target

    target = write_tiny_target(tmp_path / "target", smollm2_path, model_type="qwen2", use_sliding_window=True,
                               sliding_window=4, max_window_layers=2, **QWEN3_TINY)
    pair = target, write_tiny_drafter(tmp_path / "drafter", target)
    prompts = [[1, 520, 3011, 44, 7, 9, 8], [9, 8, 7]]
    ranks = run_tp(tmp_path, 2, *pair, prompts, 10)
    assert ranks[0] == ranks[1]
    assert ranks[0]["kv_heads"] == 1 and ranks[0]["dflash"] == ranks[0]["ar"]
    ref_tokens, ref_logits = reference(*pair, prompts, 10)
    assert ranks[0]["ar"][0] == ref_tokens
    torch.testing.assert_close(torch.tensor(ranks[0]["logits"]), ref_logits, rtol=0, atol=1e-4)


def test_tp_size_that_does_not_divide_is_refused(tiny_qwen3):
    from dflash_trt.api import load_pipeline

    with pytest.raises(ConfigError, match=r"tp_size 3 does not divide the target's attention heads \(4\), KV heads "
                                          r"\(2\).*use a tp_size that divides them: 1, 2"):
        load_pipeline(str(tiny_qwen3[0]), str(tiny_qwen3[1]), tp_size=3)
    with pytest.raises(ConfigError, match=r"tp_size 2 needs torch.distributed initialized in 2 processes: .*torchrun "
                                          r"--nproc-per-node 2"):
        load_pipeline(str(tiny_qwen3[0]), str(tiny_qwen3[1]), tp_size=2)
    with pytest.raises(ConfigError, match="tp_size must be an integer >= 1"):
        load_pipeline(str(tiny_qwen3[0]), str(tiny_qwen3[1]), tp_size=0)
    with pytest.raises(ConfigError, match=r"device 'cuda:1' with tp_size 2: each rank uses the GPU of its LOCAL_RANK "
                                          r"\(torchrun's\); give device 'cuda'"):  # before the device is looked for
        load_pipeline(str(tiny_qwen3[0]), str(tiny_qwen3[1]), tp_size=2, device="cuda:1")


@pytest.mark.slow
def test_tp3_smollm2_with_the_default_drafter(tmp_path, smollm2_path, smollm2_pipeline):
    """SmolLM2 (9 heads, 3 KV heads) over 3 processes with the trained drafter: drafts get accepted, the
    output is the greedy autoregressive output under tp, and the same tokens as one process."""
    from dflash_trt.models.default import default_drafter_path

    pipe = smollm2_pipeline
    prompts = [pipe.encode_chat("What is the capital of France?"), pipe.encode("def fibonacci(n):")]
    ranks = run_tp(tmp_path, 3, smollm2_path, default_drafter_path(), prompts, 24)
    assert all(r["dflash"] == ranks[0]["dflash"] for r in ranks)
    assert ranks[0]["dflash"] == ranks[0]["ar"]
    assert sum(ranks[0]["accepted"]) > 0
    from dflash_trt.runtime.sampling import SamplingParams

    one = pipe.generate(prompts, SamplingParams(max_tokens=24), mode="ar")
    assert ranks[0]["ar"] == [r.token_ids for r in one]
    penalized = pipe.generate(prompts, penalized_params(24), mode="ar")  # logits processing under tp: the same tokens
    assert all(r["penalized"] == ranks[0]["penalized"] for r in ranks)
    assert ranks[0]["penalized"] == [r.token_ids for r in penalized] != ranks[0]["ar"]
    guided = pipe.generate(prompts, guided_params(24), mode="ar")  # a grammar under tp: the same tokens
    assert ranks[0]["guided"] == [r.token_ids for r in guided] != ranks[0]["ar"]
    assert all(pipe.decode(ids).lstrip().startswith("{") for ids in ranks[0]["guided"])


def torchrun_generate(nproc: int, *args: str):
    """`dflash-trt generate ARGS --json --threads 1` under torchrun with `nproc` processes (a free master port);
    returns the finished process (its stdout and stderr captured as text)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from tests.serve.test_openai_server import free_port

    beside = Path(sys.executable).parent / "dflash-trt"
    exe = str(beside) if beside.is_file() else shutil.which("dflash-trt")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--master-port", str(free_port()), exe, "generate", *args, "--json", "--threads", "1"],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_generate_tp3_under_torchrun_prints_once(smollm2_pipeline):
    from dflash_trt.runtime.sampling import SamplingParams

    question = "What is the capital of France? Answer in one sentence."
    proc = torchrun_generate(3, "--tp-size", "3", "--chat", question, "--max-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    [one] = smollm2_pipeline.generate([smollm2_pipeline.encode_chat(question)], SamplingParams(max_tokens=24),
                                      mode="ar")
    assert json.loads(lines[0])["token_ids"] == one.token_ids


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no CUDA GPU")
def test_generate_tp_with_a_device_torch_cannot_use_is_one_clear_error_per_rank():
    """--device cuda without a GPU under torchrun: the --device error every command gives, from each rank, before the
    process group is initialized (it was torch's traceback "Distributed package doesn't have NCCL built in")."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from tests.serve.test_openai_server import free_port

    beside = Path(sys.executable).parent / "dflash-trt"
    exe = str(beside) if beside.is_file() else shutil.which("dflash-trt")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
                           str(free_port()), exe, "generate", "--tp-size", "3", "--device", "cuda", "--prompt", "hi",
                           "--max-tokens", "4", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count("error: --device cuda: torch sees no CUDA GPU here") == 3, proc.stderr[-3000:]
    assert "NCCL" not in proc.stderr and "dflash_trt/" not in proc.stderr, proc.stderr[-3000:]  # no rank's traceback
