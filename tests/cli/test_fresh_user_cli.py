"""Fixes from a fresh user's run of the CLI: streamed non-ASCII text, `check` on broken drafter weights,
`--device cpu:0`. Real models: SmolLM2 (the default target and drafter) and an untrained drafter for it."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import run_main

PROMPT = "日本語で挨拶: "


def test_text_to_stream_holds_back_incomplete_characters(smollm2_path):
    """Fed SmolLM2's tokens one at a time, the stream never prints U+FFFD and adds up to the final decode,
    although some token prefixes decode to a trailing U+FFFD (a character split across tokens)."""
    from transformers import AutoTokenizer

    from dflash_trt.text import text_to_stream

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tok("日本語で挨拶をします。こんにちは")["input_ids"]

    def decode(xs):
        return tok.decode(xs, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    assert any(decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))  # the case the fix is for
    shown = ""
    for i in range(1, len(ids) + 1):
        new = text_to_stream(decode(ids[:i]), shown)
        assert "\ufffd" not in new
        shown += new
    assert shown == decode(ids) == "日本語で挨拶をします。こんにちは"
    assert text_to_stream("ab\ufffd", "ab") == "" and text_to_stream("xy", "ab") == ""
    assert text_to_stream("a\ufffdb", "") == "a\ufffdb"  # U+FFFD inside the text is the text's own


@pytest.mark.slow
def test_streamed_non_ascii_text_equals_the_json_text(monkeypatch, capsys):
    """The streamed stdout of a Japanese prompt is the --json text (greedy, same run) plus a newline, in
    --mode ar (one token per callback) and dflash (blocks); it used to print U+FFFD for split characters."""
    code, out, err = run_main(monkeypatch, capsys, "generate", "--prompt", PROMPT, "--max-tokens", "24", "--mode", "ar",
                              "--json")
    assert code == 0, err
    text = json.loads(out.strip().splitlines()[-1])["text"]
    assert "\ufffd" not in text and any(ord(c) > 0x7F for c in text), text
    for mode in ("ar", "dflash"):
        code, out, err = run_main(monkeypatch, capsys, "generate", "--prompt", PROMPT, "--max-tokens", "24",
                                  "--mode", mode)
        assert code == 0, err
        assert out == text + "\n", (mode, out, text)


def test_check_refuses_truncated_drafter_weights(monkeypatch, capsys, tmp_path, smollm2_path, untrained_drafter):
    """A drafter model.safetensors cut to its first 1000 bytes: `check` names the file and the fix (the
    message generate gives), exit 1, no traceback."""
    drafter = tmp_path / "truncated"
    shutil.copytree(untrained_drafter, drafter)
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(smollm2_path), "--drafter", str(drafter))
    assert code == 1 and "Traceback" not in err, err
    assert f"error: drafter: {weights}: not a readable safetensors file (" in err
    assert "); re-save or re-download it" in err and "check failed: 1 error," in err


def test_check_reports_unexpected_drafter_keys(monkeypatch, capsys, tmp_path, smollm2_path, untrained_drafter):
    """An extra `bogus.weight` in the drafter: `check` fails naming it, as loading it in generate does;
    a KV-cache scale is unexpected too unless config.json says the KV cache is FP8 (then loading drops it)."""
    import torch
    from safetensors.torch import load_file, save_file

    drafter = tmp_path / "bogus"
    shutil.copytree(untrained_drafter, drafter)
    tensors = load_file(str(drafter / "model.safetensors"))
    save_file({**tensors, "bogus.weight": torch.zeros(3)}, str(drafter / "model.safetensors"))
    code, _, err = run_main(monkeypatch, capsys, "check", "--target", str(smollm2_path), "--drafter", str(drafter))
    assert code == 1, err
    assert f"error: drafter weights: unexpected key(s) bogus.weight in {drafter}; the checkpoint has weights" in err
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(smollm2_path), "--drafter", str(drafter),
                            "--prompt", "hi", "--max-tokens", "1")
    assert code == 1 and "unexpected key(s) bogus.weight" in err, err

    # a KV-cache scale: unexpected for check and for loading alike, unless config.json says the KV cache is FP8
    save_file({**tensors, "layers.0.self_attn.k_scale": torch.ones(())}, str(drafter / "model.safetensors"))
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(smollm2_path), "--drafter", str(drafter))
    assert code == 1 and "unexpected key(s) layers.0.self_attn.k_scale" in err, err
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(smollm2_path), "--drafter", str(drafter),
                            "--prompt", "hi", "--max-tokens", "1")
    assert code == 1 and "unexpected key(s) layers.0.self_attn.k_scale" in err, err
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "kv_cache_scheme": {"type": "float", "num_bits": 8}}
    (drafter / "config.json").write_text(json.dumps(cfg))
    code, out, err = run_main(monkeypatch, capsys, "check", "--target", str(smollm2_path), "--drafter", str(drafter))
    assert code == 0 and out.splitlines()[-1].startswith("ok: the drafter fits the target"), err
    assert err.startswith("warning: untrained: ") and out.startswith("ok:")  # an init-drafter drafter; on stderr
    code, _, err = run_main(monkeypatch, capsys, "generate", "--target", str(smollm2_path), "--drafter", str(drafter),
                            "--prompt", "hi", "--max-tokens", "1")
    assert code == 0, err


def test_device_cpu_0_is_refused_up_front(monkeypatch, capsys):
    """--device cpu:0 (torch takes it, safetensors does not) is refused naming the devices, not blamed on
    a healthy weights file."""
    from dflash_trt.errors import ConfigError
    from dflash_trt.models.checkpoints import check_device

    with pytest.raises(ConfigError, match=r"--device cpu:0: the CPU takes no index; use cpu, cuda or cuda:N"):
        check_device("cpu:0")
    check_device("cpu")
    code, out, err = run_main(monkeypatch, capsys, "generate", "--device", "cpu:0", "--prompt", "hi", "--max-tokens", "1")
    assert (code, out) == (1, "")
    assert err == "error: --device cpu:0: the CPU takes no index; use cpu, cuda or cuda:N\n"
