"""A bundle's Triton model repository (triton/dflash) served by a real tritonserver: it loads the bundle
it sits in (parameter bundle "../..") and answers as dflash-trt's runtime on that bundle does: here, with no GPU,
on the CPU in float32 (device / dtype auto), the prompt first (exclude_input_in_output's default, false, as the
TensorRT-LLM backend's)."""

from __future__ import annotations

import pytest

from dflash_trt.build.manifest import load_manifest
from tests.serve.test_triton_model import generate
from tests.serve.triton_server import TritonServer


def test_the_bundle_holds_a_hashed_triton_model(tiny_bundle_fp8_tp3):
    from dflash_trt.serve.triton_repository import model_config

    b = tiny_bundle_fp8_tp3
    m = load_manifest(b)
    assert m["triton_model_repository"] == "triton"
    assert {"triton/dflash/config.pbtxt", "triton/dflash/1/model.py"} <= set(m["files"])
    text = (b / "triton/dflash/config.pbtxt").read_text()
    assert text == model_config("dflash", {"bundle": "../..", "device": "auto", "dtype": "auto"})
    assert 'key: "device" value: { string_value: "auto" }' in text
    assert "tritonserver --model-repository THIS_FOLDER/triton" in (b / "README.md").read_text()


@pytest.mark.slow
def test_tritonserver_serves_the_bundle(tmp_path, tiny_bundle_fp8_tp3):
    import shutil

    import torch

    from dflash_trt.api import load_bundle
    from dflash_trt.runtime.sampling import SamplingParams
    from dflash_trt.serve.triton_repository import auto_device_dtype

    bundle = tmp_path / "bundle"  # a moved bundle: the model finds it relative to its own folder
    shutil.copytree(tiny_bundle_fp8_tp3, bundle)
    readme = (bundle / "README.md").read_text()
    (bundle / "README.md").write_text(readme + "edited\n")  # a file the runtime does not load: a warning, not an error
    server = TritonServer(bundle / "triton", tmp_path / "work")
    try:
        status, out = generate(server, {"text_input": "def add(a, b):", "max_tokens": 8})
    finally:
        server.stop()
    assert status == 200, out
    log = server.log.read_text()
    assert "dflash-trt: warning:" in log and "README.md" in log
    # device / dtype auto: where torch sees no GPU (here), the CPU in float32, said in Triton's log
    device, dtype, note = auto_device_dtype("auto", "auto", "bfloat16", torch.cuda.is_available())
    assert (f"dflash-trt: {note}" in log) if note else ("dflash-trt: config.pbtxt parameter 'device'" not in log)
    (bundle / "README.md").write_text(readme)
    pipe = load_bundle(bundle, dtype, device=device)
    [ref] = pipe.generate([pipe.encode("def add(a, b):")], SamplingParams(max_tokens=8), mode="dflash")
    # exclude_input_in_output false: the prompt's tokens count as output too, as the TensorRT-LLM backend counts them
    assert out["text_output"] == "def add(a, b):" + ref.text
    assert out["num_output_tokens"] == len(pipe.encode("def add(a, b):")) + len(ref.token_ids), out
    # Triton's Python backend leaves model.py's bytecode cache: still a bundle that build --force may replace
    from dflash_trt.out_folder import BUNDLE, existing_out

    assert existing_out(bundle, BUNDLE) == "a dflash-trt bundle"
