"""The `dflash-trt` command as a user runs it: real entry point, JSON output, clear errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_main


@pytest.mark.slow
def test_generate_json_on_the_default_model():
    beside = Path(sys.executable).parent / "dflash-trt"  # the venv's console script, activated or not
    exe = str(beside) if beside.is_file() else shutil.which("dflash-trt")
    assert exe, "the dflash-trt console script is not installed: pip install -e ."
    proc = subprocess.run([exe, "generate", "--chat", "What is the capital of France?", "--max-tokens", "24", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Paris" in obj["text"]
    assert obj["finish_reason"] in ("stop", "length")
    m = obj["metrics"]
    assert m["completion_tokens"] == len(obj["token_ids"]) <= 24
    assert 0.0 <= m["acceptance_rate"] <= 1.0 and m["acceptance_length"] >= 1.0
    assert set(m) >= {"drafted_tokens", "accepted_tokens", "verify_steps", "accepted_per_position",
                      "time_to_first_token_s", "tokens_per_s"}


@pytest.fixture
def drafters(tmp_path, smollm2_path, untrained_drafter):
    """Broken drafters for the default target, one per mismatch kind."""
    out = {}
    for kind in ("layer_ids", "fc_width", "vocab"):
        d = tmp_path / kind
        shutil.copytree(untrained_drafter, d)
        cfg = json.loads((d / "config.json").read_text())
        if kind == "layer_ids":
            cfg["dflash_config"]["target_layer_ids"] = [1, 8, 14, 20, 30]
        elif kind == "fc_width":
            cfg["dflash_config"]["target_layer_ids"] = [1, 8, 14, 20, 27, 29]  # weights were made for 5
        else:
            cfg["vocab_size"] = 32000
        (d / "config.json").write_text(json.dumps(cfg))
        out[kind] = d
    return out


@pytest.mark.parametrize("kind,message", [
    ("layer_ids", r"\[30\] outside \[0, 29\]"),
    ("fc_width", r"fc\.weight has shape \[576, 2880\], expected \[576, 3456\]"),
    ("vocab", r"vocab size: drafter 32000 != target 49152"),
])
def test_mismatched_drafter_errors(monkeypatch, capsys, smollm2_path, drafters, kind, message):
    import re

    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(smollm2_path), "--drafter",
                            str(drafters[kind]), "--prompt", "hi", "--max-tokens", "2")
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err
    assert re.search(message, err), err


def test_bad_paths_and_usage(monkeypatch, capsys, tmp_path):
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(tmp_path / "missing"), "--mode", "ar",
                            "--prompt", "hi")
    assert code == 1 and "no such folder" in err and "Traceback" not in err
    code, _, err = run_main(monkeypatch, capsys, "generate", "--prompt", "a", "--chat", "b")
    assert code == 2 and "exactly one of" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    code, _, err = run_main(monkeypatch, capsys, "generate", "--prompts-file", str(bad))
    assert code == 1 and "bad.jsonl:2: not valid JSON" in err
    for flag in ("--prompt", "--chat"):  # as a prompts file's blank line is refused
        code, _, err = run_main(monkeypatch, capsys, "generate", flag, "  \t ")
        assert code == 2 and f"{flag} is only whitespace; give some text" in err


def test_prompts_of_a_file_sample_with_seed_plus_their_index(monkeypatch, capsys, tmp_path):
    """--seed S: prompt i samples with seed S + i (a repeated prompt samples differently, each reproducibly),
    so line 2 of a file with --seed 5 is that prompt alone with --seed 6."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n' * 2)
    sampled = ("--max-tokens", "12", "--temperature", "1", "--json", "--batch-size", "1")
    runs = []
    for _ in range(2):
        code, out, err = run_main(monkeypatch, capsys, "generate", "--prompts-file", str(prompts), "--seed", "5", *sampled)
        assert code == 0, err
        runs.append([json.loads(line)["token_ids"] for line in out.strip().splitlines()])
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]
    code, out, err = run_main(monkeypatch, capsys, "generate", "--prompt", "Once upon a time", "--seed", "6", *sampled)
    assert code == 0, err
    assert json.loads(out)["token_ids"] == runs[0][1]


@pytest.mark.slow
def test_prompt_longer_than_the_context(monkeypatch, capsys):
    code, _, err = run_main(monkeypatch, capsys, "generate", "--mode", "ar", "--prompt", "word " * 9000)
    assert code == 1 and "context of 8192 tokens" in err and "Traceback" not in err


def test_init_drafter_writes_a_loadable_untrained_drafter(monkeypatch, capsys, tmp_path, smollm2_path):
    from dflash_trt.models.checkpoints import load_drafter

    code, out, _ = run_main(monkeypatch, capsys, "init-drafter", "--target", str(smollm2_path), "--out",
                            str(tmp_path / "d"), "--num-layers", "2", "--block-size", "8", "--mask-token-id", "16")
    assert code == 0, out
    drafter = load_drafter(tmp_path / "d")
    cfg = drafter.config
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.mask_token_id, cfg.trained) == (2, 8, 16, False)
    assert cfg.target_layer_ids == (1, 8, 14, 20, 27) and drafter.fc.weight.shape == (576, 2880)


def test_more_bad_inputs_give_one_line_errors(monkeypatch, capsys, tmp_path, smollm2_path, untrained_drafter):
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    code, _, err = run_main(monkeypatch, capsys, "generate", "--prompts-file", str(binary), "--mode", "ar")
    assert code == 1 and "not UTF-8 text" in err and "Traceback" not in err

    corrupt = tmp_path / "corrupt"
    shutil.copytree(untrained_drafter, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 16)
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(smollm2_path), "--drafter", str(corrupt),
                            "--prompt", "hi")
    assert code == 1 and "not a readable safetensors file" in err

    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tok / name).symlink_to(smollm2_path / name)
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(no_tok), "--mode", "ar", "--prompt", "hi")
    assert code == 1 and "no usable tokenizer" in err

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    code, _, err = run_main(monkeypatch, capsys, "init-drafter", "--target", str(smollm2_path), "--out", str(a_file))
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err


@pytest.mark.slow
def test_max_draft_len_flag_sets_the_drafts_verified_per_step(monkeypatch, capsys):
    """--max-draft-len 2 with the default drafter (block 16): 2 drafts per step, the same text as --mode ar."""
    args = ("--chat", "What is the capital of France?", "--max-tokens", "20", "--json")
    code, out, err = run_main(monkeypatch, capsys, "generate", *args, "--max-draft-len", "2", "--draft-confidence", "0")
    assert code == 0, err
    obj = json.loads(out.strip().splitlines()[-1])
    m = obj["metrics"]
    assert m["drafted_tokens"] == 2 * m["verify_steps"] and len(m["accepted_per_position"]) == 2
    code, out, err = run_main(monkeypatch, capsys, "generate", *args, "--mode", "ar")
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == obj["token_ids"]
    assert "warning" not in err
    code, out, err = run_main(monkeypatch, capsys, "generate", *args, "--mode", "ar", "--max-draft-len", "2")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["token_ids"] == obj["token_ids"]
    assert "warning: --max-draft-len only affects DFlash drafting; ignored here (no dflash mode runs)" in err
    code, _, err = run_main(monkeypatch, capsys, "generate", *args, "--max-draft-len", "16")
    assert code == 2 and "'--max-draft-len': 16 is more than the 15 drafts the drafter's block of 16" in err


@pytest.mark.slow
def test_draft_confidence_flag_cuts_drafts_and_keeps_the_text(monkeypatch, capsys):
    """--draft-confidence 0.3: fewer than 15 drafts verified per step, the same tokens as --mode ar;
    out of [0, 1) is a usage error before any model loads; with --mode ar it warns."""
    args = ("--chat", "What is the capital of France?", "--max-tokens", "20", "--json")
    code, out, err = run_main(monkeypatch, capsys, "generate", *args, "--draft-confidence", "0.3")
    assert code == 0, err
    obj = json.loads(out.strip().splitlines()[-1])
    m = obj["metrics"]
    assert m["drafted_tokens"] < 15 * m["verify_steps"] and len(m["accepted_per_position"]) == 15
    code, out, err = run_main(monkeypatch, capsys, "generate", *args, "--mode", "ar", "--draft-confidence", "0.3")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["token_ids"] == obj["token_ids"]
    assert "warning: --draft-confidence only affects DFlash drafting; ignored here (no dflash mode runs)" in err
    code, _, err = run_main(monkeypatch, capsys, "generate", *args, "--draft-confidence", "1")
    assert code == 2 and "--draft-confidence" in err and "0<=x<1" in err.replace(" ", "")
    code, _, err = run_main(monkeypatch, capsys, "generate", *args, "--draft-confidence", "nan")
    assert code == 2 and "nan is not a number in [0, 1)" in err
    code, _, err = run_main(monkeypatch, capsys, "generate", *args, "--draft-confidence", "high")
    assert code == 2 and "'high' is not auto or a number in [0, 1)" in err


@pytest.mark.slow
def test_tree_topk_flag_verifies_trees_and_keeps_the_text(monkeypatch, capsys):
    """--tree-topk 4: the same tokens as --mode ar in fewer verify steps than the chain (a 16-token
    verify either way); 0 or a word is a usage error; with --mode ar it warns (auto, the default, does not)."""
    args = ("--chat", "Write a Python function that reverses a string.", "--max-tokens", "32", "--json",
            "--draft-confidence", "0")
    runs = {}
    for topk in ("1", "4"):
        code, out, err = run_main(monkeypatch, capsys, "generate", *args, "--tree-topk", topk)
        assert code == 0, err
        runs[topk] = json.loads(out.strip().splitlines()[-1])
    code, out, err = run_main(monkeypatch, capsys, "generate", *args, "--mode", "ar", "--tree-topk", "4")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["token_ids"] == runs["4"]["token_ids"]
    assert "warning: --draft-confidence and --tree-topk only affect DFlash drafting" not in err  # confidence 0 is off
    assert "warning: --tree-topk only affects DFlash drafting; ignored here (no dflash mode runs)" in err
    assert runs["1"]["token_ids"] == runs["4"]["token_ids"]
    assert runs["4"]["metrics"]["verify_steps"] < runs["1"]["metrics"]["verify_steps"]
    code, _, err = run_main(monkeypatch, capsys, "generate", *args, "--tree-topk", "0")
    assert code == 2 and "--tree-topk" in err and "0 is not in the range 1<=x<=16" in err and "Traceback" not in err
    code, _, err = run_main(monkeypatch, capsys, "generate", *args, "--tree-topk", "wide")
    assert code == 2 and "'wide' is not auto or an integer in [1, 16]" in err
    code, out, err = run_main(monkeypatch, capsys, "generate", *args, "--tree-topk", "4", "--temperature", "0.8",
                              "--seed", "1", "--max-tokens", "4")
    assert code == 0 and len(json.loads(out.strip().splitlines()[-1])["token_ids"]) == 4
    assert "warning: --tree-topk 4 applies to greedy requests (--temperature 0) only" in err


def test_prompt_lookup_flag_copies_from_the_prompt_and_keeps_the_text(monkeypatch, capsys, smollm2_path,
                                                                      untrained_drafter):
    """--prompt-lookup 8 with an untrained drafter: every accepted draft is copied from the prompt,
    and the tokens are --mode ar's; out of range or a word is a usage error; --mode ar warns."""
    args = ("--target", str(smollm2_path), "--drafter", str(untrained_drafter), "--chat",
            "Repeat exactly: one two three four five six seven eight nine ten", "--max-tokens", "16", "--json")
    runs = {}
    for value in ("0", "8"):
        code, out, err = run_main(monkeypatch, capsys, "generate", *args, "--prompt-lookup", value)
        assert code == 0, err
        runs[value] = json.loads(out.strip().splitlines()[-1])
    code, out, err = run_main(monkeypatch, capsys, "generate", *args, "--mode", "ar", "--prompt-lookup", "8")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["token_ids"] == runs["8"]["token_ids"]
    assert "warning: --prompt-lookup only affects DFlash drafting; ignored here (no dflash mode runs)" in err
    assert runs["0"]["token_ids"] == runs["8"]["token_ids"]
    assert runs["8"]["metrics"]["accepted_tokens"] > runs["0"]["metrics"]["accepted_tokens"]
    for bad, why in (("64", "64 is not in the range 0<=x<=63"), ("many", "'many' is not auto or an integer in [0, 63]")):
        code, _, err = run_main(monkeypatch, capsys, "generate", *args, "--prompt-lookup", bad)
        assert code == 2 and "--prompt-lookup" in err and why in err and "Traceback" not in err
    code, _, err = run_main(monkeypatch, capsys, "generate", *args, "--prompt-lookup", "8", "--max-draft-len", "3")
    assert code == 2 and "8 is more than the 3 drafts a step verifies" in err and "use --prompt-lookup 3 or less" in err
    code, _, err = run_main(monkeypatch, capsys, "generate", *args, "--prompt-lookup", "8", "--block-size", "4")
    assert code == 2 and "8 is more than the 3 drafts a step verifies (max_draft_len); use --prompt-lookup 3 or less, " \
                         "or raise --block-size" in err and "Traceback" not in err
    code, _, err = run_main(monkeypatch, capsys, "generate", *args, "--max-draft-len", "8", "--block-size", "4")
    assert code == 2 and "'--max-draft-len': 8 is more than the 3 drafts a block of --block-size 4 holds" in err
    code, out, err = run_main(monkeypatch, capsys, "generate", *args, "--prompt-lookup", "8", "--temperature", "0.8",
                              "--seed", "1", "--max-tokens", "4")
    assert code == 0 and len(json.loads(out.strip().splitlines()[-1])["token_ids"]) == 4
    # sampling requests draft the copied tokens too (the only warning: this drafter is untrained)
    assert [w for w in err.splitlines() if w.startswith("warning") and "is untrained" not in w] == []


def test_max_concurrency_flag_keeps_the_text(monkeypatch, capsys, tmp_path):
    """Two prompts at --batch-size 2: the CPU default (auto = 1: no drafts while both are active) and
    --max-concurrency none give --mode ar's tokens; 0 or a word is a usage error; --mode ar warns."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "Name three colours."}]}\n'
                       '{"messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}]}\n')
    args = ("--prompts-file", str(prompts), "--batch-size", "2", "--max-tokens", "24", "--json")
    runs = {}
    for value in ("auto", "none", "ar"):
        extra = ("--mode", "ar", "--max-concurrency", "2") if value == "ar" else ("--max-concurrency", value)
        code, out, err = run_main(monkeypatch, capsys, "generate", *args, *extra)
        assert code == 0, err
        runs[value] = [json.loads(line) for line in out.strip().splitlines()]
        if value == "auto":
            runs_err = err
        elif value == "none":
            assert "note:" not in err
    assert "warning: --max-concurrency only affects DFlash drafting; ignored here (no dflash mode runs)" in err
    assert "note: 2 prompts decode together (--batch-size 2); DFlash drafts only while at most 1 of them is active" in runs_err
    ids = {value: [o["token_ids"] for o in objs] for value, objs in runs.items()}
    assert ids["auto"] == ids["none"] == ids["ar"] and len(ids["ar"]) == 2
    assert sum(o["metrics"]["drafted_tokens"] for o in runs["none"]) > sum(o["metrics"]["drafted_tokens"] for o in runs["auto"])
    for bad, why in (("0", "0 is not in the range x>=1"), ("all", "'all' is not auto or none or an integer >= 1")):
        code, _, err = run_main(monkeypatch, capsys, "generate", *args, "--max-concurrency", bad)
        assert code == 2 and "--max-concurrency" in err and why in err and "Traceback" not in err


def test_threads_flag_sets_torch_threads_and_rejects_zero(monkeypatch, capsys, smollm2_path, untrained_drafter):
    """--threads N sets torch's CPU threads for the command (the output does not change); 0 is a usage error
    before anything loads."""
    import torch

    args = ("--target", str(smollm2_path), "--drafter", str(untrained_drafter), "--prompt", "The capital of France is",
            "--max-tokens", "6", "--json")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        code, out, err = run_main(monkeypatch, capsys, "generate", *args)
        assert code == 0, err
        assert torch.get_num_threads() == 2
        code, out1, err = run_main(monkeypatch, capsys, "generate", *args, "--threads", "1")
        assert code == 0, err
        assert torch.get_num_threads() == 1
        assert json.loads(out1.splitlines()[-1])["token_ids"] == json.loads(out.splitlines()[-1])["token_ids"]
    finally:
        torch.set_num_threads(before)
    for bad in ("0", "-2", "two", "1025", "100000"):  # 100000 crashed the process (OpenMP could not start them)
        code, _, err = run_main(monkeypatch, capsys, "generate", "--prompt", "hi", "--threads", bad)
        assert code == 2 and "--threads" in err and "Traceback" not in err
    code, _, err = run_main(monkeypatch, capsys, "train-drafter", "--out", "x", "--threads", "5000")
    assert code == 2 and "'--threads': 5000 is not in the range 1<=x<=1024" in err


def test_more_threads_than_cores_warns(monkeypatch, capsys):
    import os

    import torch

    from dflash_trt.cli.common import set_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    try:
        set_threads(2)
        assert capsys.readouterr().err == "" and torch.get_num_threads() == 2
        set_threads(3)
        assert capsys.readouterr().err == ("warning: --threads 3 is more than this machine's 2 CPU cores; expect it "
                                           "to be slower than --threads 2\n")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_prompts_file_prompt_too_long_names_file_and_line(monkeypatch, capsys, tmp_path, smollm2_path):
    """A --prompts-file prompt that fills the target's context: 'FILE:LINE: ...' (blank lines counted), its
    length, the context, the fix, and the other lines too long; exit 1. A prompt that fits generates, and one
    completion token is '1 token' in the stats line."""
    from tests.bench.test_bench_cli import short_context_target

    target = short_context_target(tmp_path / "t", smollm2_path, 32, weights=True)
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "hi"}\n\n' + json.dumps({"prompt": "word " * 40}) + "\n")
    base = ("generate", "--target", str(target), "--mode", "ar", "--cpu-kernels", "off", "--max-tokens", "1")
    code, out, err = run_main(monkeypatch, capsys, *base, "--prompts-file", str(long))
    assert code == 1 and out == "" and "Traceback" not in err
    assert err == (f"error: {long}:3: prompt 2 of 2 (1 too long) is 41 tokens and leaves no room in the target's context "
                   "of 32 tokens; shorten it to at most 31 tokens or remove that line\n")
    code, out, err = run_main(monkeypatch, capsys, *base, "--prompt", "word " * 40)
    assert code == 1 and err == ("error: the prompt is 41 tokens and leaves no room in the target's context of 32 "
                                 "tokens; shorten it to at most 31 tokens\n")
    code, out, err = run_main(monkeypatch, capsys, *base, "--prompt", "The capital of France is")
    assert code == 0, err
    assert err.startswith("[ar] 1 token, finish=length, TTFT="), err  # ar drafts nothing: no tau or acceptance rate


def test_context_and_sampling_messages_count_in_words(capsys):
    """One prompt / token is singular; the too-long error lists the other prompts; --seed with greedy
    decoding is named like --top-p / --top-k ("applies" for one flag, "apply" for several)."""
    from dflash_trt.cli.common import check_prompt_lengths, warn_context_room, warn_sampling_unused
    from dflash_trt.text import count
    from dflash_trt.errors import PromptTooLongError

    assert (count(1, "prompt"), count(0, "token"), count(2, "token")) == ("1 prompt", "0 tokens", "2 tokens")
    warn_context_room([[0] * 31], 32, 5)
    assert "the prompt takes 31, so at most 1 token is generated" in capsys.readouterr().err
    warn_context_room([[0] * 31, [0] * 2, [0]], 32, 5)
    assert "1 of the 3 prompts leaves room for only 1 token (those stop" in capsys.readouterr().err
    warn_context_room([[0] * 31, [0] * 29, [0]], 32, 5)
    assert "2 of the 3 prompts leave room for only 1 to 3 tokens (those stop" in capsys.readouterr().err
    check_prompt_lengths([[0] * 31], 32)  # fits: one token of room
    with pytest.raises(PromptTooLongError, match=r"^prompt 2 of 9 \(8 too long; also 3, 4, 5, 6, 7, \.\.\.\) is 32 "
                       r"tokens and leaves no room in the target's context of 32 tokens; shorten it to at most 31 "
                       r"tokens$"):
        check_prompt_lengths([[0]] + [[0] * 32] * 8, 32)

    warn_sampling_unused(0.0, seed=7)
    assert capsys.readouterr().err == ("warning: --seed 7 only applies when sampling (--temperature > 0); greedy "
                                       "decoding ignores it\n")
    warn_sampling_unused(0.0, 0.5)
    assert "warning: --top-p 0.5 only applies when sampling" in capsys.readouterr().err
    warn_sampling_unused(0.0, 0.5, 3, 0)
    assert "warning: --top-p 0.5, --top-k 3 and --seed 0 only apply when sampling" in capsys.readouterr().err
    warn_sampling_unused(0.0, min_p=0.1)
    assert "warning: --min-p 0.1 only applies when sampling" in capsys.readouterr().err
    warn_sampling_unused(0.7, 0.5, 3, 0, 0.1)
    warn_sampling_unused(0.0)
    assert capsys.readouterr().err == ""


def test_generate_seed_with_greedy_decoding_warns_before_loading(monkeypatch, capsys):
    import dflash_trt.api

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded")

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", no_loading)
    with pytest.raises(AssertionError, match="loaded"):
        run_main(monkeypatch, capsys, "generate", "--prompt", "Hi", "--seed", "1")
    assert ("warning: --seed 1 only applies when sampling (--temperature > 0); greedy decoding ignores it"
            in capsys.readouterr().err)


def test_an_untrained_drafter_warns_as_check_does(monkeypatch, capsys, smollm2_path, untrained_drafter):
    code, out, err = run_main(monkeypatch, capsys, "generate", "--target", str(smollm2_path), "--drafter",
                              str(untrained_drafter), "--prompt", "Hello", "--max-tokens", "2")
    assert code == 0, err
    assert f"warning: the drafter at {untrained_drafter} is untrained" in err
    code, out, err = run_main(monkeypatch, capsys, "generate", "--prompt", "Hello", "--max-tokens", "2")
    assert code == 0, err
    assert "untrained" not in err  # the shipped drafter is trained


def other_targets_drafter(folder, drafter) -> tuple:
    """(a copy of `drafter` in `folder` whose training.json says it was trained for another target, the
    warning line `dflash-trt check` gives for it with SmolLM2 as the target `here`)."""
    from dflash_trt.models.default import default_target_path

    copy = shutil.copytree(drafter, folder / "drafter")
    (copy / "training.json").write_text(json.dumps({"target": "/models/Llama-3.1-8B-Instruct", "finished": True}))
    here = default_target_path().resolve()
    return copy, (f"warning: training target: the drafter's training.json says it was trained for the target "
                  f"/models/Llama-3.1-8B-Instruct (Llama-3.1-8B-Instruct), not {here} (SmolLM2-135M-Instruct); fine "
                  "if this target is a sibling of that one (same tokenizer and layers, e.g. a fine-tune of it), "
                  "otherwise the drafter was made for another model (acceptance will be low): use the drafter "
                  f"trained for this target, or train one with dflash-trt train-drafter --target {here}")


def test_a_drafter_trained_for_another_target_warns_as_check_does(monkeypatch, capsys, tmp_path, smollm2_path,
                                                                   untrained_drafter):
    """generate said nothing when the drafter's training.json names another target; check and build warned."""
    drafter, warning = other_targets_drafter(tmp_path, untrained_drafter)
    code, _, err = run_main(monkeypatch, capsys, "check", "--target", str(smollm2_path), "--drafter", str(drafter))
    assert code == 0 and warning in err.splitlines(), err
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(smollm2_path), "--drafter", str(drafter),
                            "--prompt", "Hello", "--max-tokens", "2")
    assert code == 0, err
    assert [line for line in err.splitlines() if line.startswith("warning: training target:")] == [warning]
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(smollm2_path), "--drafter", str(drafter),
                            "--prompt", "Hello", "--max-tokens", "2", "--mode", "ar")
    assert code == 0 and "training target" not in err, err  # no drafter loaded


@pytest.mark.slow
def test_logits_processing_flags_give_the_pipelines_tokens(monkeypatch, capsys, smollm2_pipeline):
    """--repetition-penalty, --presence-penalty, --frequency-penalty, --logit-bias and --min-tokens: the text of the
    pipeline with those SamplingParams; a --logit-bias id beyond the vocabulary is a usage error once it is loaded."""
    from dflash_trt.runtime.sampling import SamplingParams

    prompt = "1, 2, 3, 4, 5,"  # plain: " 6, 7, 8, 9,"
    flags = ("--repetition-penalty", "1.3", "--presence-penalty", "0.5", "--frequency-penalty", "0.5",
             "--logit-bias", "28:-100", "--logit-bias", " 13 : 2.5", "--min-tokens", "12")
    code, out, err = run_main(monkeypatch, capsys, "generate", "--prompt", prompt, "--max-tokens", "12", *flags)
    assert code == 0, err
    params = SamplingParams(max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5,
                            logit_bias={28: -100, 13: 2.5}, min_tokens=12)
    [ref] = smollm2_pipeline.generate([smollm2_pipeline.encode(prompt)], params)
    [plain] = smollm2_pipeline.generate([smollm2_pipeline.encode(prompt)], SamplingParams(max_tokens=12))
    assert out == ref.text + "\n" and ref.text != plain.text and "," not in ref.text  # token 28: ","
    code, _, err = run_main(monkeypatch, capsys, "generate", "--prompt", prompt, "--mode", "ar", "--logit-bias", "49152:1")
    assert code == 2 and "Invalid value for '--logit-bias': token 49152 is outside the target's vocabulary [0, 49152)" in err


def test_bad_word_flags_give_the_pipelines_tokens(monkeypatch, capsys, smollm2_pipeline):
    """--bad-word (repeatable): the text of the pipeline with those words' sequences banned (`bad_word_ids`); an empty
    word is a usage error before anything loads."""
    import dflash_trt.api
    from dflash_trt.runtime.penalties import bad_word_ids
    from dflash_trt.runtime.sampling import SamplingParams

    pipe = smollm2_pipeline
    chat = "What is the capital of France? Answer in one sentence."
    code, out, err = run_main(monkeypatch, capsys, "generate", "--chat", chat, "--max-tokens", "16", "--bad-word", "Paris",
                              "--bad-word", "capital of")
    assert code == 0, err
    bad = bad_word_ids(["Paris", "capital of"], lambda w: pipe.tokenizer.encode(w, add_special_tokens=False))
    [ref] = pipe.generate([pipe.encode_chat(chat)], SamplingParams(max_tokens=16, bad_words=bad))
    assert out == ref.text + "\n" and "Paris" not in out
    monkeypatch.setattr(dflash_trt.api, "load_pipeline", lambda *a, **k: pytest.fail("models were loaded"))
    code, _, err = run_main(monkeypatch, capsys, "generate", "--chat", chat, "--bad-word", "")
    assert code == 2 and "Invalid value for '--bad-word': a word is empty" in err


def test_stop_flags_end_the_answer_before_the_first_stop_string(monkeypatch, capsys, smollm2_pipeline):
    """--stop (repeatable): the streamed answer and --json's text and token ids are the pipeline's with those stop
    strings (no part of a stop string is streamed); an empty one is a usage error before anything loads."""
    import json

    import dflash_trt.api
    from dflash_trt.runtime.sampling import SamplingParams

    pipe = smollm2_pipeline
    chat = "Write a short poem about the sea."
    [full] = pipe.generate([pipe.encode_chat(chat)], SamplingParams(max_tokens=32))
    stops = [full.text[25:31], full.text[12:17]]  # the second comes first in the text
    [ref] = pipe.generate([pipe.encode_chat(chat)], SamplingParams(max_tokens=32, stop=stops))
    assert ref.finish_reason == "stop" and ref.text == full.text[: full.text.index(stops[1])]
    flags = ["generate", "--chat", chat, "--max-tokens", "32", "--stop", stops[0], "--stop", stops[1]]
    code, out, err = run_main(monkeypatch, capsys, *flags)
    assert code == 0, err
    assert out == ref.text + "\n" and "finish=stop" in err
    code, out, err = run_main(monkeypatch, capsys, *flags, "--json")
    assert code == 0, err
    got = json.loads(out)
    assert (got["text"], got["token_ids"], got["finish_reason"]) == (ref.text, ref.token_ids, "stop")
    assert got["stop_reason"] == stops[1]
    monkeypatch.setattr(dflash_trt.api, "load_pipeline", lambda *a, **k: pytest.fail("models were loaded"))
    code, _, err = run_main(monkeypatch, capsys, "generate", "--chat", chat, "--stop", "")
    assert code == 2 and "Invalid value for '--stop': a stop string is empty" in err



def test_a_stop_flag_with_a_typed_backslash_escape_warns(capsys):
    """--stop "\\n" (what a shell passes for "\n" in double quotes: a backslash and an n) warns, naming bash's $'\\n';
    a real newline, and text without an escape, do not."""
    from dflash_trt.cli.common import warn_escaped_stops

    warn_escaped_stops(["\\n", "end\\t", "\n", "plain"])
    err = capsys.readouterr().err.splitlines()
    assert err == ['warning: --stop "\\n" holds a backslash and "n" (two characters), not a newline: the shell passes '
                   "them as typed; for a newline use bash's $'\\n'",
                   'warning: --stop "end\\t" holds a backslash and "t" (two characters), not a tab: the shell passes '
                   "them as typed; for a tab use bash's $'\\t'"]


@pytest.mark.slow
def test_structured_output_flags_give_the_pipelines_tokens(monkeypatch, capsys, smollm2_pipeline, tmp_path):
    """--json-schema (a file or the text), --json-object, --regex and --grammar (a file): the text of the pipeline
    with that GuidedDecoding."""
    from dflash_trt.runtime.guided import GuidedDecoding
    from dflash_trt.runtime.sampling import SamplingParams

    schema = '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
    (tmp_path / "s.json").write_text(schema)
    (tmp_path / "g.ebnf").write_text('root ::= "It is " ("Paris" | "Rome") "."\n')
    question = "What is the capital of France?"
    ids = smollm2_pipeline.encode_chat(question)
    for flags, spec in ((["--json-schema", str(tmp_path / "s.json")], GuidedDecoding(json=schema)),
                        (["--json-schema", schema], GuidedDecoding(json=schema)),
                        (["--json-object"], GuidedDecoding(json_object=True)),
                        (["--regex", "(Paris|Rome)"], GuidedDecoding(regex="(Paris|Rome)")),
                        (["--grammar", str(tmp_path / "g.ebnf")],
                         GuidedDecoding(grammar='root ::= "It is " ("Paris" | "Rome") "."\n'))):
        code, out, err = run_main(monkeypatch, capsys, "generate", "--chat", question, "--max-tokens", "24", *flags)
        assert code == 0, err
        [ref] = smollm2_pipeline.generate([ids], SamplingParams(max_tokens=24, guided=spec))
        assert out == ref.text + "\n", flags
    assert out in ("It is Paris.\n", "It is Rome.\n")
    code, out, err = run_main(monkeypatch, capsys, "generate", "--chat", question, "--regex", "(a")
    assert code == 2 and out == "" and "Invalid value for '--regex': guided decoding: the regex does not compile" in err


def test_structured_output_flags_are_checked_before_loading(monkeypatch, capsys):
    import dflash_trt.api

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", lambda *a, **k: pytest.fail("models were loaded"))
    for flags, message in (
            (["--regex", "a", "--json-object"], "--json-object and --regex exclude each other"),
            (["--json-schema", "{bad"], "Invalid value for '--json-schema': guided decoding: the JSON schema is not JSON"),
            (["--json-object", "--min-tokens", "2"], "error: --min-tokens and --json-object do not go together: once "
                                                     "the answer is complete, the grammar allows only the stop tokens, "
                                                     "which --min-tokens holds back; drop --min-tokens (see"),
            (["--grammar", "/"], "Invalid value for '--grammar': / is a directory; give a file, or the text itself"),
            (["--grammar", "nosuch.gbnf"], "Invalid value for '--grammar': no file nosuch.gbnf, and not a grammar either "
                                           "(no rule such as root ::= ...); give an EBNF grammar file or the grammar text"),
            (["--regex", ""], "Invalid value for '--regex': guided decoding: regex must be a non-empty string, got '' (see"),
            (["--json-schema", '{"allOf": []}'], "keyword 'allOf' (at #) is not supported")):
        code, _, err = run_main(monkeypatch, capsys, "generate", "--prompt", "hi", "--max-tokens", "4", *flags)
        assert code in (1, 2) and message in err and err.count("\n") == 1, err
    code, _, err = run_main(monkeypatch, capsys, "bench", "--regex", "a+", "--min-tokens", "2", "--modes", "dflash")
    assert code == 2 and err.startswith("error: --min-tokens and --regex do not go together"), err


def test_logits_processing_flags_that_do_not_fit_together_are_refused_before_loading(monkeypatch, capsys):
    import dflash_trt.api

    def no_load(*_a, **_k):
        raise AssertionError("models were loaded before the flags were checked")

    monkeypatch.setattr(dflash_trt.api, "load_pipeline", no_load)
    code, _, err = run_main(monkeypatch, capsys, "generate", "--prompt", "hi", "--max-tokens", "4", "--min-tokens", "5")
    assert code == 2 and "Invalid value for '--min-tokens': 5 is more than --max-tokens 4" in err
    code, _, err = run_main(monkeypatch, capsys, "generate", "--prompt", "hi", "--logit-bias", "5:1", "--logit-bias", "5:2")
    assert code == 2 and "Invalid value for '--logit-bias': token 5 is given twice" in err


def test_prefix_caching_flag_reuses_a_shared_few_shot_prefix_across_batches(monkeypatch, capsys, tmp_path,
                                                                          smollm2_pipeline):
    """--enable-prefix-caching with --batch-size 1: each prompt after the first is prefilled past the few-shot
    prefix it shares with the prompts read before (metrics.cached_tokens), with the tokens of a run without it;
    --prefix-cache-gb alone warns."""
    shots = "Q: capital of Italy? A: Rome. Q: capital of Spain? A: Madrid. Q: capital of Japan? A: Tokyo. "
    questions = ["Q: capital of France? A:", "Q: capital of Egypt? A:", "Q: capital of Canada? A:"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": shots + q}) + "\n" for q in questions))
    args = ("generate", "--prompts-file", str(prompts), "--batch-size", "1", "--max-tokens", "6", "--json")
    code, out, err = run_main(monkeypatch, capsys, *args, "--enable-prefix-caching", "--prefix-cache-gb", "0.25")
    assert code == 0, err
    cached = [json.loads(line) for line in out.strip().splitlines()]
    code, out, err = run_main(monkeypatch, capsys, *args, "--prefix-cache-gb", "0.25")
    assert code == 0 and "warning: --prefix-cache-gb has no effect without --enable-prefix-caching" in err
    plain = [json.loads(line) for line in out.strip().splitlines()]
    assert [o["token_ids"] for o in cached] == [o["token_ids"] for o in plain]
    ids = [smollm2_pipeline.encode(shots + q) for q in questions]

    def shared(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    # what each reuses: its longest shared prefix with a prompt read before and that prompt's answer
    seen = [ids[k] + cached[k]["token_ids"] for k in range(3)]
    want = [0] + [max(shared(ids[k][:-1], seen[j]) for j in range(k)) for k in (1, 2)]
    assert want[1] >= len(smollm2_pipeline.encode(shots)) - 1
    assert [o["metrics"]["cached_tokens"] for o in cached] == want
    assert [o["metrics"]["cached_tokens"] for o in plain] == [0, 0, 0]
    # in one batch (--batch-size 3): the first is read whole, the others copy the few-shot part from its row
    code, out, err = run_main(monkeypatch, capsys, *args[:4], "3", *args[5:], "--enable-prefix-caching")
    together = [json.loads(line) for line in out.strip().splitlines()]
    assert code == 0 and [o["token_ids"] for o in together] == [o["token_ids"] for o in plain]
    assert [o["metrics"]["cached_tokens"] for o in together] == [0] + [shared(ids[k][:-1], ids[0]) for k in (1, 2)]
