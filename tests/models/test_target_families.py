"""Qwen2 (Qwen2.5) and Mistral targets vs transformers: q/k/v biases, sliding-window attention in prefill,
chunked prefill, decode and verify (chains, draft trees, rejected drafts rolled back), and the config fields
that choose which layers slide."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_trt.config import TargetConfig
from dflash_trt.errors import ConfigError
from dflash_trt.models.checkpoints import init_drafter, load_drafter, load_target, new_drafter_config
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams
from tests.conftest import make_hf_model
from tests.runtime.oracle import OracleProposer

#: (model_type, config overrides): a window of 5 positions (prompts are 23 tokens) on the layers that slide
FAMILIES = {
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=2)),
    "qwen2": ("qwen2", {}),
    "mistral-window": ("mistral", dict(sliding_window=5)),
    "mistral": ("mistral", {}),
}


_BUILT: dict = {}


def _family(name, tmp_path_factory):
    """(name, HF model, folder, our TargetModel), made once per module."""
    if name not in _BUILT:
        model_type, overrides = FAMILIES[name]
        hf, folder = make_hf_model(tmp_path_factory.mktemp(name), model_type, seed=3, **overrides)
        _BUILT[name] = name, hf, folder, load_target(folder)
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return _family(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=[name for name in FAMILIES if name.endswith("window")])
def windowed(request, tmp_path_factory):
    """The families with sliding-window layers (the runtime paths the others share with Llama / Qwen3)."""
    return _family(request.param, tmp_path_factory)


def prompt(n=23, seed=1):
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def hf_greedy(hf, ids, n):
    out = hf.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_config_reads_biases_and_windows(family):
    name, hf, _, ours = family
    cfg = ours.config
    assert cfg.qkv_bias == name.startswith("qwen2") and not cfg.attention_bias and not cfg.mlp_bias
    attn = ours.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None, attn.k_proj.bias is not None, attn.v_proj.bias is not None,
            attn.o_proj.bias is None) == (cfg.qkv_bias, cfg.qkv_bias, cfg.qkv_bias, True)
    windows = {"qwen2-window": (None, None, 5, 5), "mistral-window": (5, 5, 5, 5)}.get(name, (None,) * 4)
    assert tuple(cfg.layer_window(i) for i in range(4)) == windows
    if name.startswith("qwen2"):  # the same layers as transformers' own reading of the config
        assert [w is not None for w in windows] == [t == "sliding_attention" for t in hf.config.layer_types]


def test_prefill_logits_match_transformers(family):
    name, hf, _, ours = family
    ids = prompt()
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids, torch.arange(23)[None], ours.new_cache(1, 24), 23).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
    if name.endswith("window"):  # the window changes these logits: the comparison above tests it
        full = hf.config.to_dict() | {"sliding_window": None, "use_sliding_window": False, "layer_types": None}
        unwindowed = type(hf)(type(hf.config)(**{k: v for k, v in full.items() if k != "transformers_version"}))
        unwindowed.load_state_dict(hf.state_dict())
        with torch.no_grad():
            assert (unwindowed.eval()(ids).logits - ref).abs().max() > 1e-2


def test_chunked_prefill_and_decode_match_transformers(family):
    """A prompt read in chunks of 7 positions (the later chunks see keys of earlier ones through the cache and
    the window), then 12 one-token decode steps, against transformers' logits of the whole sequence."""
    _, hf, _, ours = family
    ids = prompt(35, seed=2)
    with torch.no_grad():
        ref = hf(ids).logits[0]
        cache = ours.new_cache(1, 40)
        got = []
        for lo, hi in [(0, 7), (7, 14), (14, 23)] + [(p, p + 1) for p in range(23, 35)]:
            got.append(ours(ids[:, lo:hi], torch.arange(lo, hi)[None], cache, hi).logits[0])
    torch.testing.assert_close(torch.cat(got), ref, rtol=0, atol=1e-4)


def test_greedy_decoding_matches_transformers_generate(family):
    _, hf, _, ours = family
    ids = prompt()
    got = Engine(ours).generate([ids[0].tolist()], SamplingParams(max_tokens=24, ignore_eos=True), "ar")[0]
    assert got.token_ids == hf_greedy(hf, ids, 24)


@pytest.mark.parametrize("wrong", [(), (1, 3, 5)])
def test_verify_blocks_with_accepted_and_rejected_drafts_equal_autoregressive(windowed, wrong):
    """Blocks of 8 (longer than the window) verified in one pass each: drafts of the known greedy continuation,
    some replaced by wrong tokens (rejected, their K/V rolled back and overwritten), in a batch of two rows at
    different positions."""
    _, _, _, ours = windowed
    prompts = [prompt()[0].tolist(), prompt(9, seed=5)[0].tolist()]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ar = [Engine(ours).generate([p], params, "ar")[0].token_ids for p in prompts]
    oracle = OracleProposer([p + r for p, r in zip(prompts, ar)], 8, wrong_positions=wrong, vocab_size=96)
    out = Engine(ours, oracle).generate(prompts, params, "dflash")
    assert [r.token_ids for r in out] == ar
    accepted = sum(r.metrics.accepted_tokens for r in out)
    assert accepted > 0 if 1 not in wrong else accepted == 0  # (1, 3, 5): every block rejected at its first draft


def test_a_deep_draft_tree_is_masked_by_position_not_slot(windowed):
    """A tree whose chain sits under siblings: its node at depth 7 is at slot start + 10 and its ancestor at depth 2
    at slot start + 5, so a window of 5 masks that ancestor by position (start + 2 <= start + 7 - 5) where the
    slots alone would keep it. Each path node's logits equal those of the path decoded as a plain sequence."""
    from dflash_trt.runtime.draft_tree import node_depths, tree_attention_mask

    _, _, _, ours = windowed
    ids = prompt(20, seed=6)
    tokens = torch.tensor([[7, 11, 12, 13, 14, 21, 22, 23, 24, 25, 26]])  # root, 4 siblings, a chain under node 4
    parents = torch.tensor([[0, 0, 0, 0, 4, 5, 6, 7, 8, 9]])
    path = [0, 4, 5, 6, 7, 8, 9, 10]
    start = torch.tensor([20])
    with torch.no_grad():
        cache = ours.new_cache(1, 40)
        ours(ids, torch.arange(20)[None], cache, 20)
        tree = ours(tokens, start[:, None] + node_depths(parents), cache, 31, slots=20 + torch.arange(11)[None],
                    attn_mask=tree_attention_mask(parents, start, 31)).logits[0, path]
        seq = torch.cat([ids, tokens[:, path]], dim=1)
        ref = ours(seq, torch.arange(28)[None], ours.new_cache(1, 40), 28).logits[0, 20:]
    torch.testing.assert_close(tree, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("tree_topk", [1, 3])
def test_dflash_with_an_initialised_drafter_equals_autoregressive(windowed, tmp_path, tree_topk):
    """A drafter from init-drafter's Python API, chains and draft trees (nodes at slot start + i but position
    start + depth: the window masks by position), with prompt lookup drafting copies of a repeated prompt."""
    _, _, folder, ours = windowed
    dcfg = new_drafter_config(TargetConfig.from_pretrained(folder), 1, 8, 95, [1, 3])
    drafter = load_drafter(init_drafter(dcfg, tmp_path / "drafter", seed=2))
    engine = Engine(ours, DFlashProposer(drafter, ours, tree_topk=tree_topk, prompt_lookup=4))
    base = prompt(11, seed=4)[0].tolist()
    prompts = [base * 3, prompt()[0].tolist()]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ar = [Engine(ours).generate([p], params, "ar")[0].token_ids for p in prompts]
    out = engine.generate(prompts, params, "dflash")
    assert [r.token_ids for r in out] == ar
    assert sum(r.metrics.verify_steps for r in out) < 48  # drafts were accepted, blocks verified


def write_config(tmp_path, **cfg):
    base = dict(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(base | cfg))
    return tmp_path


def test_qwen2_without_layer_types_slides_the_layers_from_max_window_layers(tmp_path):
    """Configs written before transformers had `layer_types` (Qwen2.5's own): layers i >= max_window_layers slide,
    only with use_sliding_window true (Qwen2.5 ships it false: every layer full)."""
    cfg = TargetConfig.from_pretrained(write_config(tmp_path, use_sliding_window=True, sliding_window=8,
                                                    max_window_layers=3))
    assert [cfg.layer_window(i) for i in range(4)] == [None, None, None, 8]
    cfg = TargetConfig.from_pretrained(write_config(tmp_path, use_sliding_window=False, sliding_window=131072,
                                                    max_window_layers=28))
    assert cfg.sliding_window is None and cfg.layer_types == () and cfg.qkv_bias


def test_qwen2_sliding_layer_without_a_window_is_refused(tmp_path):
    folder = write_config(tmp_path, use_sliding_window=False, sliding_window=8,
                          layer_types=["full_attention"] * 3 + ["sliding_attention"])
    with pytest.raises(ConfigError, match="'layer_types' marks layer 3 'sliding_attention' but no window is set.*"
                                          "set use_sliding_window true"):
        TargetConfig.from_pretrained(folder)
    with pytest.raises(ConfigError, match="'layer_types' must list one of full_attention, sliding_attention per "
                                          "layer \\(4 entries\\)"):
        TargetConfig.from_pretrained(write_config(tmp_path, layer_types=["full_attention"]))
    with pytest.raises(ConfigError, match="'sliding_window' must be an integer"):
        TargetConfig.from_pretrained(write_config(tmp_path, model_type="mistral", sliding_window="4096"))


def test_mistral_bias_flags_are_ignored_as_transformers_does(tmp_path):
    cfg = TargetConfig.from_pretrained(write_config(tmp_path, model_type="mistral", attention_bias=True,
                                                    mlp_bias=True, sliding_window=None))
    assert not (cfg.attention_bias or cfg.mlp_bias or cfg.qkv_bias) and cfg.layer_types == ()


@pytest.mark.parametrize("chunk", [None, 4])
def test_prefix_cache_hits_on_a_windowed_target_give_the_same_tokens(windowed, tmp_path, chunk):
    """Prompts sharing a 30-token prefix (6 windows of 5) read it from the prefix cache, one at a time and then
    together, in DFlash (draft trees) and AR mode, with and without chunked prefill: the same tokens as AR
    without a cache."""
    from dflash_trt.runtime.decode_batch import DecodeBatch
    from dflash_trt.runtime.prefix_cache import PrefixCache

    _, _, folder, ours = windowed
    dcfg = new_drafter_config(TargetConfig.from_pretrained(folder), 1, 8, 95, [1, 3])
    drafter = load_drafter(init_drafter(dcfg, tmp_path / "drafter", seed=2))
    base = prompt(30, seed=7)[0].tolist()
    prompts = [base + prompt(k, seed=k)[0].tolist() for k in (3, 9, 1)] + [base[:12] + [5, 6, 7]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ar = [Engine(ours).generate([p], params, "ar")[0].token_ids for p in prompts]
    for mode in ("ar", "dflash"):
        engine = Engine(ours, DFlashProposer(drafter, ours, tree_topk=3, prompt_lookup=4))
        engine.prefix_cache = PrefixCache(1 << 30)
        got = []
        for group in [[p] for p in prompts] + [prompts]:
            batch = DecodeBatch(engine, mode, chunk)
            batch.add(group, [params] * len(group))
            while batch.active:
                batch.step()
            got.append([r.token_ids for _, r in sorted(batch.take_finished())])
        assert got == [[a] for a in ar] + [ar], mode
        # one at a time: the 30 shared tokens twice, then 12; together: each whole prompt but its last token
        assert engine.prefix_cache.hit_tokens == (30 + 30 + 12) + (32 + 38 + 30 + 14)
