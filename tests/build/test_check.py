"""`dflash-trt check`: one tiny target/drafter pair per mismatch kind; each is caught with its fix."""

import json
import subprocess
import sys

import pytest
from build_helpers import build_bundle, write_tiny_drafter, write_tiny_target

from dflash_trt.compat import ERROR, WARNING, check_checkpoints


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if key in ("mask_token_id", "target_layer_ids", "target_hidden_size"):
            cfg["dflash_config"][key] = value
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def target(tmp_path_factory, smollm2_path):
    return write_tiny_target(tmp_path_factory.mktemp("t") / "target", smollm2_path)


@pytest.fixture
def drafter(tmp_path, target):
    return write_tiny_drafter(tmp_path / "drafter", target)


def only(findings, level):
    return [f.message for f in findings if f.level == level]


def test_matching_pair_passes(target, drafter):
    assert only(check_checkpoints(target, drafter), ERROR) == []


# (config edit of the drafter, text the one error must contain)
CASES = {
    "vocab": (dict(vocab_size=32000), "vocab size: drafter 32000 != target 49152"),
    "hidden": (dict(hidden_size=128), "hidden size: drafter 128 != target 96"),
    "layer_ids": (dict(target_layer_ids=[1, 4]), "[4] outside [0, 3] (the target has 4 layers)"),
    "fc_width": (dict(target_hidden_size=64), "fc width: fc expects 128 = 2 x 64 input features"),
    "mask_id": (dict(mask_token_id=49152), "mask_token_id 49152 is outside the target vocabulary [0, 49152)"),
    "num_target_layers": (dict(num_target_layers=30), "the drafter was made for a target with 30 layers"),
    "block_size": (dict(block_size=1), "'block_size' must be at least 2, got 1"),
    "block_size_context": (dict(block_size=300), "block_size 300 does not fit the context (256 positions"),
    "block_size_edge": (dict(block_size=255), "block_size 255 does not fit the context (256 positions"),
    "weights": (dict(intermediate_size=256), "drafter weights: layers.0.mlp.gate_proj.weight has shape [192, 96]"),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_mismatch_kind_is_an_error_with_a_fix(kind, target, drafter):
    changes, expected = CASES[kind]
    errors = only(check_checkpoints(target, edit_config(drafter, **changes)), ERROR)
    assert any(expected in e for e in errors), errors
    if kind not in ("hidden", "weights", "fc_width"):  # these also (correctly) break the weight shapes
        assert len(errors) == 1, errors


def test_different_tokenizer_is_an_error(target, drafter):
    tok = json.loads((target / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    word = next(w for w, i in vocab.items() if i == 1000)
    vocab[word + "x"] = vocab.pop(word)
    (drafter / "tokenizer.json").write_text(json.dumps(tok))
    errors = only(check_checkpoints(target, drafter), ERROR)
    assert len(errors) == 1 and "tokenizer.json differs from the target's" in errors[0]
    (drafter / "tokenizer.json").write_text((target / "tokenizer.json").read_text())
    assert only(check_checkpoints(target, drafter), ERROR) == []


@pytest.mark.parametrize("content", ['{"model": {"vocab": ', '[1, 2]', '{"added_tokens": [{"content": "x"}]}', '{}',
                                     '{"model": {"vocab": ["a", "b"]}}', '{"model": {"vocab": {"a": 0}}, "added_tokens": '
                                     '[{"id": 1e400, "content": "x"}]}', '{"model": {"vocab": {"a": 0}}, "added_tokens": '
                                     '[{"id": 1, "content": {"x": 1}}]}', '{"model": {"vocab": ' + "[" * 100_000])
def test_a_drafter_tokenizer_file_that_is_not_one_is_a_warning_naming_it(target, drafter, content):
    """check raised a traceback on a drafter folder whose tokenizer.json is not JSON (or not a tokenizer); the runtime
    never loads the drafter's tokenizer, so it is a warning naming the file, and the rest of the check still runs."""
    (drafter / "tokenizer.json").write_text(content)
    findings = check_checkpoints(target, drafter)
    assert only(findings, ERROR) == []
    warnings = [w for w in only(findings, WARNING) if w.startswith("tokenizer:")]
    named = f"tokenizer: {drafter / 'tokenizer.json'} is not a tokenizer file ("
    assert len(warnings) == 1 and warnings[0].startswith(named), warnings
    assert warnings[0].endswith("replace it with the target's tokenizer.json or delete it")
    run = subprocess.run([sys.executable, "-c", "from dflash_trt.cli import main; main()", "check",
                          "--target", str(target), "--drafter", str(drafter)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0 and "Traceback" not in run.stderr
    assert "is not a tokenizer file" in run.stdout + run.stderr


def test_shorter_drafter_context_rope_and_plain_mask_are_warnings(target, drafter):
    edit_config(drafter, max_position_embeddings=128, rope_theta=1e6, mask_token_id=300)
    findings = check_checkpoints(target, drafter)
    assert only(findings, ERROR) == []
    warnings = only(findings, WARNING)
    assert len(warnings) == 4
    assert warnings[0].startswith("untrained: the drafter's config.json marks it untrained")  # init-drafter's
    assert "max_position_embeddings 128 is below the target's 256; past position 124 drafting stops" in warnings[1]
    assert "rope_theta 1e+06" in warnings[2] and "target's 10000" in warnings[2]
    assert "id 300 is not a special token" in warnings[3] and warnings[3].endswith("as dflash_config.mask_token_id")


def test_an_untrained_drafter_is_a_warning(target, drafter):
    """init-drafter's untrained marker gives one warning (tau ~1.0 is slower than ar); a drafter
    without it (trained) gets none."""
    warnings = only(check_checkpoints(target, drafter), WARNING)
    assert [w for w in warnings if w.startswith("untrained:")] == [warnings[0]] and "tau ~1.0" in warnings[0]
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg.pop("dflash_trt") == {"untrained": True}
    (drafter / "config.json").write_text(json.dumps(cfg))
    assert not [w for w in only(check_checkpoints(target, drafter), WARNING) if w.startswith("untrained:")]


def test_drafting_stops_at_the_drafter_context_and_output_is_unchanged(target, drafter):
    """The warning's promise: a drafter with a short context does not crash the runtime, and output == AR."""
    from dflash_trt.api import load_pipeline
    from dflash_trt.runtime.sampling import SamplingParams

    edit_config(drafter, max_position_embeddings=24)
    pipe = load_pipeline(target, drafter)
    prompt = pipe.encode("def add(a, b):")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    spec, ar = pipe.generate([prompt], params, "dflash")[0], pipe.generate([prompt], params, "ar")[0]
    assert spec.token_ids == ar.token_ids and len(spec.token_ids) == 40
    # blocks of 4 fit below position 24 only while start + 4 <= 24: later steps draft nothing
    assert spec.metrics.drafted_tokens < 3 * spec.metrics.verify_steps


def test_cli_exit_codes(target, drafter, tmp_path):
    run = [sys.executable, "-c", "from dflash_trt.cli import main; main()", "check", "--target", str(target), "--drafter"]
    ok = subprocess.run(run + [str(drafter)], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1].startswith("ok: the drafter fits the target"), ok.stderr
    assert ok.stderr.startswith("warning: untrained: ")  # the tiny drafter is init-drafter's; diagnostics on stderr
    assert ok.stdout.startswith("ok: ")
    bad = subprocess.run(run + [str(edit_config(drafter, vocab_size=32000))], capture_output=True, text=True)
    assert bad.returncode == 1 and "error: vocab size: drafter 32000 != target 49152" in bad.stderr
    assert "Traceback" not in bad.stderr
    missing = subprocess.run(run + [str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 1 and "no such folder" in missing.stderr


def test_a_target_without_tokenizer_files_is_an_error_naming_the_files_and_the_fix(tmp_path, target, drafter):
    """check passed a target with no tokenizer files (exit 0, a warning) that the runtime then refused: every way
    dflash-trt runs a target loads its tokenizer. Now it is an error (exit 1) naming the files and the fix, as is a
    tokenizer file that does not load (a tokenizer.model that is not one); a slow tokenizer that loads (vocab.json
    and merges.txt) only leaves the identity unchecked (a warning)."""
    import shutil

    from dflash_trt.api import load_pipeline
    from dflash_trt.errors import CheckpointError

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy2(target / f, bare / f)
    expected = (f"tokenizer: {bare} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json); the runtime "
                "encodes prompts and decodes answers with the target's tokenizer, so generate, bench, serve and "
                "train-drafter cannot run this target, nor a bundle built from it (generate --bundle, trtllm-serve): "
                "copy the model's tokenizer files (tokenizer.json, tokenizer_config.json) into the folder")
    assert only(check_checkpoints(bare, drafter), ERROR) == [expected]
    assert not [w for w in only(check_checkpoints(bare, drafter), WARNING) if w.startswith("tokenizer:")]
    with pytest.raises(CheckpointError, match="no usable tokenizer"):  # what the error stands for
        load_pipeline(bare, drafter)
    run = [sys.executable, "-c", "from dflash_trt.cli import main; main()", "check", "--target", str(bare), "--drafter",
           str(drafter)]
    res = subprocess.run(run, capture_output=True, text=True, check=False)
    assert res.returncode == 1 and res.stdout == "", res.stderr
    assert f"error: {expected}" in res.stderr.splitlines() and "check failed: 1 error, 1 warning" in res.stderr
    (bare / "tokenizer.model").write_bytes(b"sentencepiece")  # not a tokenizer: AutoTokenizer's error, an error
    [error] = only(check_checkpoints(bare, drafter), ERROR)
    assert error.startswith("tokenizer: the target's tokenizer does not load as the runtime loads it (transformers' "
                            "AutoTokenizer), so generate, bench, serve and train-drafter cannot run this target, nor a "
                            f"bundle built from it: {bare}: no usable tokenizer ("), error
    assert error.endswith("); copy the model's tokenizer files (tokenizer.json, tokenizer_config.json) into the folder")
    (bare / "tokenizer.model").unlink()  # a slow tokenizer that loads (GPT-2's vocab.json and merges.txt): a warning
    model = json.loads((target / "tokenizer.json").read_text())["model"]
    (bare / "vocab.json").write_text(json.dumps(model["vocab"]))
    (bare / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{' '.join(m)}\n" for m in model["merges"]))
    (bare / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    assert only(check_checkpoints(bare, drafter), ERROR) == []
    assert [w for w in only(check_checkpoints(bare, drafter), WARNING) if w.startswith("tokenizer:")] == [
        f"tokenizer: {bare} has no tokenizer.json; tokenizer identity and the mask token were not checked"]


def test_a_drafter_config_not_named_dflashdraftmodel_is_a_warning(target, drafter):
    """A drafter config.json with a dflash_config but architectures LlamaForCausalLM loads here (by its
    dflash_config) but not necessarily in the serving engines: warned, with the fix."""
    assert not [w for w in only(check_checkpoints(target, drafter), WARNING) if w.startswith("architectures:")]
    findings = check_checkpoints(target, edit_config(drafter, architectures=["LlamaForCausalLM"]))
    assert only(findings, ERROR) == []
    assert [w for w in only(findings, WARNING) if w.startswith("architectures:")] == [
        "architectures: the drafter's config.json has [\"LlamaForCausalLM\"], not [\"DFlashDraftModel\"] (the z-lab "
        "format); dflash-trt reads it by its dflash_config, but TensorRT-LLM's, SGLang's and vLLM's DFlash loaders "
        'may not: set "architectures": ["DFlashDraftModel"]']


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_drafter_holding_nan_or_inf_is_refused_by_check_and_by_loading(target, drafter, bad):
    """Non-finite drafter weights never fail a forward loudly (greedy drafts just stop being accepted, sampled
    ones crashed torch.multinomial): `check` and `load_drafter` name the tensor."""
    from safetensors.torch import load_file, save_file

    from dflash_trt.errors import CheckpointError
    from dflash_trt.models.checkpoints import load_drafter

    path = drafter / "model.safetensors"
    tensors = load_file(path)
    key = next(k for k in sorted(tensors) if k.endswith("down_proj.weight"))
    tensors[key][0, 0] = bad
    save_file(tensors, path, metadata={"format": "pt"})
    errors = only(check_checkpoints(target, drafter), ERROR)
    assert len(errors) == 1 and f"'{key}' holds NaN or infinite values" in errors[0] and "retrain or re-export" in errors[0]
    with pytest.raises(CheckpointError, match=f"'{key}' holds NaN or infinite values"):
        load_drafter(drafter)


def test_an_fp8_drafter_with_a_non_finite_scale_is_refused_naming_the_scale(target, drafter):
    """A ModelOpt FP8 drafter whose weight_scale is inf: `check` and `load_drafter` name the scale (loading had
    named the weight it dequantizes to, which holds no inf as stored)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from dflash_trt.errors import CheckpointError
    from dflash_trt.models.checkpoints import load_drafter

    path = drafter / "model.safetensors"
    tensors = load_file(path)
    key = next(k for k in sorted(tensors) if k.endswith("down_proj.weight"))
    base = key.removesuffix(".weight")
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    tensors[base + ".weight_scale"] = torch.tensor(float("inf"))
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (drafter / "config.json").write_text(json.dumps(cfg))
    errors = only(check_checkpoints(target, drafter), ERROR)
    assert len(errors) == 1 and f"'{base}.weight_scale' holds NaN or infinite values" in errors[0], errors
    with pytest.raises(CheckpointError, match=f"'{base}.weight_scale' holds NaN or infinite values"):
        load_drafter(drafter)
    tensors[base + ".weight_scale"] = torch.tensor(0.5)  # the same drafter with a finite scale loads
    save_file(tensors, path, metadata={"format": "pt"})
    assert load_drafter(drafter).layers[0].mlp.down_proj.weight.dtype == torch.float32


def test_the_largest_block_that_fits_the_context_passes(target, drafter):
    """A block starts at the last committed token: 254 positions of 256 leave room after a 2-token prompt."""
    assert only(check_checkpoints(target, edit_config(drafter, block_size=254)), ERROR) == []


def test_weights_that_overflow_float16_are_named_as_such(drafter):
    """A finite checkpoint whose values overflow the --dtype it is loaded in is not called corrupt: the message
    says to load it wider; in float32 it loads."""
    from safetensors.torch import load_file, save_file

    import torch

    from dflash_trt.errors import CheckpointError
    from dflash_trt.models.checkpoints import load_drafter

    path = drafter / "model.safetensors"
    tensors = load_file(path)
    key = next(k for k in sorted(tensors) if k.endswith("input_layernorm.weight"))
    tensors[key][0] = 70000.0  # above float16's largest, 65504
    save_file(tensors, path, metadata={"format": "pt"})
    assert load_drafter(drafter).layers[0].input_layernorm.weight[0].item() == 70000.0
    with pytest.raises(CheckpointError, match="its weights overflow float16 .* load it in float32 or bfloat16"):
        load_drafter(drafter, dtype=torch.float16)


def test_target_layer_ids_out_of_order_are_warned(target, drafter):
    """vLLM collects the target's hidden states (aux hidden states) as its layers run; a drafter whose
    target_layer_ids are not increasing would get its fc inputs permuted there: a warning, not an error (dflash-trt
    and the z-lab reference read them in the order given)."""
    ids = json.loads((drafter / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    assert len(ids) >= 2 and ids == sorted(ids)
    assert not [w for w in only(check_checkpoints(target, drafter), WARNING) if w.startswith("layer order:")]
    edit_config(drafter, target_layer_ids=ids[::-1])
    findings = check_checkpoints(target, drafter)
    assert only(findings, ERROR) == []
    assert [w for w in only(findings, WARNING) if w.startswith("layer order:")] == [
        f"layer order: target_layer_ids {ids[::-1]} is not in increasing order; dflash-trt and the z-lab reference "
        "concatenate the target's hidden states in the order given, but vLLM collects its aux hidden states as the "
        "target's layers run (increasing order), so fc would get its inputs permuted there: retrain (or re-export) the drafter "
        "with sorted layer ids"]


def test_a_mask_token_that_occurs_in_text_is_warned(target, drafter):
    """A special token that text or the chat template produces (SmolLM2's <|endoftext|> = 0, <|im_start|> = 1)
    as the mask: warned as init-drafter warns (check had only warned on ordinary tokens)."""
    def mask_warnings():
        return [w for w in only(check_checkpoints(target, drafter), WARNING) if w.startswith("mask token:")]

    assert mask_warnings() == []  # the tiny drafter's mask: a spare special token
    for mask, name in ((0, "'<|endoftext|>'"), (1, "'<|im_start|>'")):
        edit_config(drafter, mask_token_id=mask)
        assert mask_warnings() == [
            f"mask token: id {mask} ({name}) is a special token that occurs in the target's text (BOS / EOS / PAD / UNK "
            "or a chat-template marker), so a block can hold it as both a mask and a word. Pick a special token that "
            "text never holds as dflash_config.mask_token_id (init-drafter chooses one)"]


def test_a_bundle_target_goes_by_the_name_of_the_target_it_was_built_from(tmp_path, smollm2_path):
    """A bundle's target folder is NAME/trtllm/target, whatever the model: `check` on a bundle's target and drafter
    compares training.json's target with the folder the bundle was built from (manifest.json's models.target.source),
    so a drafter trained for that target gets no "training target" warning there, and one trained for another does."""
    target = write_tiny_target(tmp_path / "tiny-llama", smollm2_path)
    drafter = write_tiny_drafter(tmp_path / "drafter", target)
    (drafter / "training.json").write_text(json.dumps({"target": str(target.resolve())}))  # as train-drafter records it
    bundle = tmp_path / "bundle"
    build_bundle(target, drafter, bundle, quant="none")
    assert json.loads((bundle / "trtllm" / "drafter" / "training.json").read_text())["target"] == str(target.resolve())

    def training_target_warnings():
        findings = check_checkpoints(bundle / "trtllm" / "target", bundle / "trtllm" / "drafter")
        assert only(findings, ERROR) == []
        return [w for w in only(findings, WARNING) if w.startswith("training target:")]

    assert training_target_warnings() == []
    other = tmp_path / "models" / "tiny-other"
    (bundle / "trtllm" / "drafter" / "training.json").write_text(json.dumps({"target": str(other)}))
    [warning] = training_target_warnings()
    assert warning.startswith(f"training target: the drafter's training.json says it was trained for the target {other} "
                              f"(tiny-other), not {(bundle / 'trtllm' / 'target').resolve()} (tiny-llama); ")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "{}"])
def test_an_unreadable_training_json_is_a_warning(tmp_path, smollm2_path, text):
    """A training.json that is not a readable JSON object is named: the checks that read it were skipped."""
    target = write_tiny_target(tmp_path / "tiny-llama", smollm2_path)
    drafter = write_tiny_drafter(tmp_path / "drafter", target)
    findings = check_checkpoints(target, drafter)
    assert not [w for w in only(findings, WARNING) if w.startswith("training.json:")]
    (drafter / "training.json").write_text(text)
    findings = check_checkpoints(target, drafter)
    assert only(findings, ERROR) == []
    [warning] = [w for w in only(findings, WARNING) if w.startswith("training.json:")]
    assert warning.startswith(f"training.json: {drafter / 'training.json'} is not a readable JSON object")
