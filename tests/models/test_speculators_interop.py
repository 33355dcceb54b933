"""The speculators format against vLLM's `speculators` library itself (its reader, writer and z-lab converter).

speculators runs in a separate Python (`build_scripts/speculators_venv.sh`; it pins its own dependencies), named
by SPECULATORS_PYTHON; without it these tests skip. Each direction decodes with the shipped drafter's weights:
- ours -> speculators: `DFlashDraftModel.from_pretrained` reads our export (every tensor equal, its target layer
  ids = our target_layer_ids + 1), saves it again, and our runtime decodes with that save exactly as with the
  original (tokens and accepted drafts per position);
- speculators -> ours: speculators' `DFlashConverter` turns our z-lab full-vocabulary copy into its format, and
  our runtime decodes with that exactly as with the z-lab copy.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

SPECULATORS_PYTHON = os.environ.get("SPECULATORS_PYTHON")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not SPECULATORS_PYTHON, reason="set SPECULATORS_PYTHON to a Python with vLLM's speculators library "
                                   "(build_scripts/speculators_venv.sh) to check the format against it")]

READ_AND_RESAVE = """
import json, sys, torch
from safetensors.torch import load_file
from speculators.models.dflash import DFlashDraftModel
src, dst = sys.argv[1], sys.argv[2]
model = DFlashDraftModel.from_pretrained(src)
state, ours = model.state_dict(), load_file(src + "/model.safetensors")
model.save_pretrained(dst)
print(json.dumps({"target_layer_ids": list(model.target_layer_ids), "block_size": model.config.block_size,
                  "mask_token_id": model.config.mask_token_id, "draft_vocab_size": model.config.draft_vocab_size,
                  "mismatched": [k for k, v in ours.items() if not torch.equal(state[k].to(v.dtype), v)],
                  "keys": len(ours)}))
"""

CONVERT = """
import sys
from speculators.convert.dflash.converter import DFlashConverter
DFlashConverter().convert(sys.argv[1], sys.argv[2], base_model=sys.argv[3], validate=True)
"""


def _speculators(script: str, *args) -> str:
    r = subprocess.run([SPECULATORS_PYTHON, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _same_decoding(drafter_a, drafter_b) -> None:
    from dflash_trt.api import load_pipeline
    from dflash_trt.runtime.sampling import SamplingParams

    chain = dict(dtype="float32", draft_confidence=0.0, tree_topk=1, prompt_lookup=0, max_concurrency=None)
    a, b = load_pipeline(drafter=str(drafter_a), **chain), load_pipeline(drafter=str(drafter_b), **chain)
    prompts = [a.encode_chat("Write a haiku about the sea."), a.encode("def fibonacci(n):\n    ")]
    params = SamplingParams(max_tokens=40)
    for x, y in zip(a.generate(prompts, params), b.generate(prompts, params)):
        assert x.token_ids == y.token_ids
        assert x.metrics.accepted_per_position == y.metrics.accepted_per_position
    assert sum(x.metrics.accepted_tokens for x in a.generate(prompts, params)) > 0


def test_speculators_reads_our_export_and_we_read_its_save(tmp_path, smollm2_path):
    from dflash_trt.config import DrafterConfig
    from dflash_trt.models.default import default_drafter_path
    from dflash_trt.training.export import speculators_copy

    ours = speculators_copy(default_drafter_path(), tmp_path / "ours", smollm2_path)
    seen = json.loads(_speculators(READ_AND_RESAVE, ours, tmp_path / "resaved").strip().splitlines()[-1])
    cfg = DrafterConfig.from_pretrained(default_drafter_path())
    assert seen == {"target_layer_ids": [i + 1 for i in cfg.target_layer_ids], "block_size": cfg.block_size,
                    "mask_token_id": cfg.mask_token_id, "draft_vocab_size": cfg.draft_vocab_size, "mismatched": [],
                    "keys": seen["keys"]}
    assert DrafterConfig.from_pretrained(tmp_path / "resaved").target_layer_ids == cfg.target_layer_ids
    _same_decoding(tmp_path / "resaved", default_drafter_path())


def test_we_read_what_the_speculators_converter_writes(tmp_path, smollm2_path):
    from dflash_trt.models.default import default_drafter_path
    from dflash_trt.training.export import full_vocab_copy

    zlab = full_vocab_copy(default_drafter_path(), tmp_path / "zlab")
    _speculators(CONVERT, zlab, tmp_path / "converted", smollm2_path)
    assert json.loads((tmp_path / "converted/config.json").read_text())["speculators_model_type"] == "dflash"
    _same_decoding(tmp_path / "converted", zlab)
