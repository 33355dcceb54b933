"""What a bundle says about itself: README.md files that state the quantization the manifest records, and
the drafter's figures (PNG) copied beside the Markdown that refers to them, so its links resolve."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from build_helpers import build_bundle, write_tiny_drafter

from dflash_trt.build.manifest import load_manifest
from dflash_trt.models.default import default_drafter_path

#: a Markdown link or image target, or an HTML src / href
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)|(?:src|href)=\"([^\"]+)\"")
FIGURE_LINKS = "\n![loss curve](loss.png) ![acceptance](./acceptance.png) [per-set table](acceptance.md#set)\n"


def relative_links(md: Path) -> list[str]:
    """The relative file links of a Markdown file (fragments dropped; URLs and in-page anchors left out)."""
    out = []
    for m in LINK.finditer(md.read_text()):
        link = (m.group(1) or m.group(2)).split("#")[0]
        if link and "://" not in link and not link.startswith("mailto:"):
            out.append(link)
    return out


def drafter_with_figures(folder: Path, target: Path, **changes) -> Path:
    """A tiny drafter carrying what a trained export carries beside its weights: the default drafter's
    README.md (plus links to its figures), acceptance.md and PNGs, and a training.json."""
    write_tiny_drafter(folder, target, **changes)
    src = default_drafter_path()
    for f in src.iterdir():
        if f.suffix in (".md", ".png"):
            shutil.copy2(f, folder / f.name)
    (folder / "README.md").write_text((src / "README.md").read_text() + FIGURE_LINKS)
    (folder / "training.json").write_text('{"steps": 3}\n')
    return folder


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, tiny_pair):
    """{"plain": a --quant none bundle of a reduced-vocabulary drafter (runtime/drafter copied as given,
    trtllm/drafter its full-vocabulary copy), "fp8": a --quant fp8 --drafter-quant fp8 --kv-cache-dtype
    fp8 bundle of a full-vocabulary drafter}, with the sources of their drafters."""
    target, _ = tiny_pair
    root = tmp_path_factory.mktemp("readmes")
    reduced = drafter_with_figures(root / "reduced", target, draft_vocab_size=1024)
    full = drafter_with_figures(root / "full", target)
    build_bundle(target, reduced, root / "plain", quant="none")
    build_bundle(target, full, root / "fp8", quant="fp8", drafter_quant="fp8", kv_cache_dtype="fp8")
    return {"plain": root / "plain", "fp8": root / "fp8", "reduced": reduced, "full": full}


def test_readmes_state_the_quantization_the_manifest_records(bundles):
    """The FP8 bundle's README, its target's and its drafter's say FP8 (what is quantized, the scales,
    the loaders, what dflash-trt does on a CPU); the plain bundle's READMEs claim no FP8 anywhere."""
    fp8, plain = bundles["fp8"], bundles["plain"]
    m = load_manifest(fp8)  # the READMEs are hashed with the rest
    assert {"README.md", "trtllm/target/README.md", "trtllm/drafter/README.md"} <= set(m["files"])
    assert m["quantization"]["target"] == "fp8" and m["quantization"]["drafter"] == "fp8"

    top = (fp8 / "README.md").read_text()
    assert top.startswith(f"# dflash-trt bundle {fp8.name}\n")
    assert "- Target: **FP8**: ModelOpt `FP8_DEFAULT_CFG` (W8A8, per tensor)" in top
    assert "float8_e4m3fn with a float32 `weight_scale`" in top and "`input_scale`" in top
    assert "kept in bfloat16: embeddings, norms, lm_head." in top  # the manifest's exclude_modules
    assert "- KV cache: **FP8**" in top and "- Drafter: **FP8**" in top
    assert "on a CPU dequantizes the FP8 weights once at load time" in top
    assert "trtllm/launch.sh" in top and "trtllm_checkpoint/build_engine.sh" in top
    # Triton: the command that works where make installed nvidia-pytriton, and the container's
    assert "`dflash-trt triton --model-repository THIS_FOLDER/triton`" in top
    assert "in NVIDIA's Triton container (nvcr.io/nvidia/tritonserver:YY.MM-py3, dflash-trt installed into its " \
        "Python) `tritonserver --model-repository THIS_FOLDER/triton`" in top
    assert "ModelOpt max calibration on 4 prompts (built-in corpus)" in top
    target = (fp8 / "trtllm/target/README.md").read_text()
    assert "- Target: **FP8**" in target and "on a CPU dequantizes the FP8 weights" in target
    assert "- TensorRT-LLM's drafter (`trtllm/drafter/`): not quantized: TensorRT-LLM's DFlash loader" in top
    assert m["models"]["drafter"]["path"] == "runtime/drafter"
    drafter = (fp8 / "runtime/drafter/README.md").read_text()
    assert drafter.startswith("# DFlash drafter\n")  # written for the FP8 drafter: the source's described it unquantized
    assert "## Quantization in this bundle\n\n- Drafter: **FP8**" in drafter
    assert "already at `trtllm/drafter` (what `serve.yaml` names; z-lab format, not quantized)" in drafter
    trt = (fp8 / "trtllm/drafter/README.md").read_text()  # TensorRT-LLM's: the source's own README, then the section
    assert trt.startswith((bundles["full"] / "README.md").read_text())
    assert ("## Quantization in this bundle\n\n- Drafter: not quantized: TensorRT-LLM's DFlash loader "
            "(`tensorrt_llm/_torch/models/modeling_dflash.py`) makes `fc` a plain Linear") in trt
    assert "(the FP8 drafter dflash-trt loads is in `runtime/drafter/`)" in trt and "already at" not in trt

    assert load_manifest(plain)["quantization"]["target"] == "none"
    readmes = ["README.md", "trtllm/target/README.md", "trtllm/drafter/README.md", "runtime/drafter/README.md"]
    for rel in readmes:
        text = (plain / rel).read_text()
        assert "FP8" not in text and "NVFP4" not in text, rel
    assert "- Target: **not quantized**: weights in bfloat16" in (plain / "README.md").read_text()
    for rel in readmes[2:]:
        assert "## Quantization in this bundle\n\n- Drafter: not quantized" in (plain / rel).read_text(), rel
    # the drafter as given keeps its README, with the section after it
    given = (bundles["reduced"] / "README.md").read_text()
    assert (plain / "runtime/drafter/README.md").read_text().startswith(given)


def test_drafter_figures_are_copied_and_readme_links_resolve(bundles):
    """Each drafter folder holds the source drafter's PNGs where its Markdown goes (the full-vocabulary
    and FP8 copies leave out acceptance.*, measured on other drafts), and every relative link in its
    README.md / acceptance.md names a file there."""
    pngs = {f.name for f in bundles["reduced"].glob("*.png")}
    assert pngs == {"loss.png", "acceptance.png"}
    plain, fp8 = bundles["plain"], bundles["fp8"]
    runtime = plain / "runtime/drafter"
    assert {f.name for f in runtime.glob("*.png")} == pngs
    for name in pngs:
        assert (runtime / name).read_bytes() == (bundles["reduced"] / name).read_bytes()
    assert {f.name for f in (plain / "trtllm/drafter").glob("*.png")} == {"loss.png"}
    assert {f.name for f in (fp8 / "trtllm/drafter").glob("*.png")} == pngs  # the drafter as given: its acceptance too
    assert {f.name for f in (fp8 / "runtime/drafter").glob("*.png")} == {"loss.png"}  # FP8: acceptance measured before
    assert set(relative_links(runtime / "README.md")) == {"loss.png", "./acceptance.png", "acceptance.md"}
    checked = 0
    for folder in (runtime, plain / "trtllm/drafter", fp8 / "trtllm/drafter", fp8 / "runtime/drafter"):
        for md in ("README.md", "acceptance.md"):
            if (folder / md).is_file():
                for link in relative_links(folder / md):
                    assert (folder / link).is_file(), f"{folder / md}: {link}"
                    checked += 1
    assert checked == 6
    manifest = load_manifest(plain)["files"]
    assert {"runtime/drafter/loss.png", "runtime/drafter/acceptance.png", "trtllm/drafter/loss.png"} <= set(manifest)
