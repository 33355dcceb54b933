"""A bundle's Triton model repository (triton/dflash) served by a real tritonserver: it loads the bundle
it sits in (parameter bundle "../..") and answers as dflash-trt's runtime on that bundle does."""

from __future__ import annotations

import pytest

from dflash_trt.build.manifest import load_manifest
from tests.serve.test_triton_model import generate
from tests.serve.triton_server import TritonServer


def test_the_bundle_holds_a_hashed_triton_model(tiny_bundle_fp8_tp3):
    from dflash_trt.serve.triton import model_config

    b = tiny_bundle_fp8_tp3
    m = load_manifest(b)
    assert m["triton_model_repository"] == "triton"
    assert {"triton/dflash/config.pbtxt", "triton/dflash/1/model.py"} <= set(m["files"])
    assert (b / "triton/dflash/config.pbtxt").read_text() == model_config("dflash", {"bundle": "../.."})
    assert "tritonserver --model-repository THIS_FOLDER/triton" in (b / "README.md").read_text()


@pytest.mark.slow
def test_tritonserver_serves_the_bundle(tmp_path, tiny_bundle_fp8_tp3):
    import shutil

    from dflash_trt.api import load_bundle
    from dflash_trt.runtime.sampling import SamplingParams

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
    assert "dflash-trt: warning:" in server.log.read_text() and "README.md" in server.log.read_text()
    (bundle / "README.md").write_text(readme)
    pipe = load_bundle(bundle)
    [ref] = pipe.generate([pipe.encode("def add(a, b):")], SamplingParams(max_tokens=8), mode="dflash")
    assert out["text_output"] == ref.text and out["num_output_tokens"] == len(ref.token_ids)
    # Triton's Python backend leaves model.py's bytecode cache: still a bundle that build --force may replace
    from dflash_trt.out_folder import BUNDLE, existing_out

    assert existing_out(bundle, BUNDLE) == "a dflash-trt bundle"
