"""A randomized differential check of the runtime's scheduler (`DecodeBatch`) against the plain reference.

A workload (`make_workload`, from one seed) is 2-6 greedy requests with random prompts (a long shared prefix,
identical ones, 1-2 tokens, near the context limit where the model's context is small), random SamplingParams
(max_tokens, stop tokens, stop strings through `StopText` as the server checks them, min_tokens, penalties,
logit_bias, bad_words, logprobs, prompt_logprobs) and random aborts, added to a DecodeBatch at random steps with
random settings (mode, prefill_chunk, a prefix cache of random bounds or none, the proposer's max_draft_len / draft
confidence / tree_topk / prompt lookup / max_concurrency, lazy_logits). `run_workload` runs it and checks every
request against the reference: the request generated ALONE in mode "ar" without prefix cache or chunking. Reused
K/V and chunked shapes may change logits in their last bits, so a token mismatch where the reference's top two
processed scores are within NEAR_TIE is reported as a near-tie, anything else as a bug. It also checks finish
reasons, cached_tokens, logprobs (within LOGPROB_TOL) and the prefix cache's invariants after the workload.

Run many seeds: `python -m tests.runtime.scheduler_fuzz --env tiny --seeds 0:100` (see `main`).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch

from dflash_trt.runtime.decode_batch import DecodeBatch
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.prefix_cache import PrefixCache
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.stop_text import StopText

NEAR_TIE = 1e-4  # top-2 gap of the reference's processed scores under which a token flip is float rounding
LOGPROB_TOL = 1e-4
#: logprob differences between LOGPROB_TOL and this are reported as rounding, not bugs: SmolLM2's packed CPU kernels
#: give prompt logprobs of a prefill chunked 1 / 2 / 5 positions at a time up to 3.5e-4 from the whole prefill's
LOGPROB_BUG = 2e-3

TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again.",
    "Write a short poem about the sea, the sky and the wind.",
    "Question: What is the capital of France?\nAnswer:",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):\n    def __init__(self):",
]


@dataclass
class Env:
    """A model to fuzz: its engine, a decode (ids -> text) for stop strings, and how to encode text (or None)."""

    name: str
    engine: Engine
    decode: object
    encode: object = None
    pc: PrefixCache | None = None  # a prefix cache kept between workloads (reuse)
    pc_uses: int = 0
    pc_stored: list = field(default_factory=list)  # what was stored in `pc`: (tokens, target K/V, drafter K/V)
    refs: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)  # what the workloads exercised: counts by name


@dataclass
class Req:
    prompt: list[int]
    params: SamplingParams
    join: int  # the step before which it is added
    group: int  # requests of one join step and group go in one add call
    stops: tuple[str, ...] = ()
    engine_stops: bool = False  # the stops go in params.stop (the engine checks them) instead of serve's StopText
    abort_after: int | None = None  # on_tokens returns "abort" once it has this many tokens
    abort_prefill_at: int | None = None  # abort_prefill([id]) before this step


@dataclass
class Workload:
    seed: int
    mode: str
    chunk: int | None
    cache: str  # "off", "new", "reuse"
    cache_bytes: int
    proposer: dict
    lazy_logits: int
    reqs: list[Req]

    def describe(self) -> str:
        return (f"seed={self.seed} mode={self.mode} chunk={self.chunk} cache={self.cache}:{self.cache_bytes} "
                f"proposer={self.proposer} lazy={self.lazy_logits} n={len(self.reqs)}")


def _token_bytes(engine: Engine, mode: str) -> int:
    cfg = engine.target.config
    per = 2 * cfg.num_hidden_layers * engine.target.new_cache(1, 1).k[0].shape[1] * cfg.head_dim * 4
    if mode == "dflash":
        d = engine.proposer.drafter.config
        per += 2 * d.num_hidden_layers * d.num_key_value_heads * d.head_dim * 4
    return per


def make_workload(env: Env, seed: int) -> Workload:
    rng = random.Random(seed)
    eng = env.engine
    vocab, ctx = eng.target.config.vocab_size, eng.context_len
    small_ctx = ctx <= 1024
    mode = "dflash" if eng.proposer is not None and rng.random() < 0.7 else "ar"
    chunk = None if rng.random() < 0.5 else rng.choice([1, 2, 3, rng.randint(1, 40), rng.randint(1, 40)])
    cache = rng.choice(["off", "new", "new", "reuse", "reuse", "reuse"])
    tb = _token_bytes(eng, "dflash" if eng.proposer is not None else "ar")
    cache_bytes = rng.choice([tb * rng.randint(1, 60), tb * rng.randint(60, 400), tb * rng.randint(60, 400), 1 << 31,
                              1 << 31])
    proposer = {}
    if eng.proposer is not None:
        b = eng.proposer.block_size
        k = rng.choice([b - 1, b - 1, rng.randint(1, b - 1)])
        proposer = dict(max_draft_len=k, draft_confidence=rng.choice([0.0, 0.0, 0.2, 0.5]),
                        tree_topk=rng.choice([1, 1, 2, 4]), prompt_lookup=rng.choice([0, 0, rng.randint(1, k)]),
                        max_concurrency=rng.choice([None, None, 1, 2, 3]))
    lazy = rng.choice([3, 3, 0, 1, 5])

    def rand_tokens(n):
        return [rng.randrange(3, vocab - 1) for _ in range(n)]

    # the shared prefix: one of three fixed "system prompts" (which a reused prefix cache may hold), a text, random
    systems = random.Random(vocab)
    systems = [[systems.randrange(3, vocab - 1) for _ in range(n)] for n in (24, 45, 90)]
    u = rng.random()
    if u < 0.4:
        shared = rng.choice(systems) + rand_tokens(rng.choice([0, 0, 5, 20]))
    elif env.encode is not None and u < 0.8:
        shared = env.encode(rng.choice(TEXTS) + " " + rng.choice(TEXTS))
    else:
        shared = rand_tokens(rng.randint(10, 40 if small_ctx else 120))
    shared = shared[: ctx - 30]
    n = rng.randint(2, 6)
    prompts = []
    for i in range(n):
        kind = rng.choice(["shared", "shared", "identical", "short", "random", "near"] if small_ctx
                          else ["shared", "shared", "identical", "short", "random", "text"])
        if kind == "identical" and prompts:
            p = list(rng.choice(prompts))
        elif kind == "short":
            p = rand_tokens(rng.randint(1, 2))
        elif kind == "random":
            p = rand_tokens(rng.randint(3, 40))
        elif kind == "near":
            p = rand_tokens(ctx - rng.randint(1, 12))
        elif kind == "text" and env.encode is not None:
            p = env.encode(rng.choice(TEXTS))
        else:
            p = shared[: rng.randint(max(1, len(shared) - 5), len(shared))] + rand_tokens(rng.choice([0, 0, 1, 3, 9]))
        prompts.append(p)
    reqs = []
    for i, p in enumerate(prompts):
        mt = rng.randint(1, 24)
        pool = p + rand_tokens(3)
        kw = dict(max_tokens=mt)
        if rng.random() < 0.3:
            kw["min_tokens"] = rng.randint(0, mt)
        if rng.random() < 0.25:
            kw["stop_token_ids"] = tuple(rng.sample(pool, min(len(pool), rng.randint(1, 3))))
        if rng.random() < 0.2:
            kw["ignore_eos"] = True
        if rng.random() < 0.25:
            kw["repetition_penalty"] = rng.choice([1.3, 0.8, 1.1])
        if rng.random() < 0.2:
            kw["presence_penalty"] = rng.choice([0.5, -0.5, 1.5])
        if rng.random() < 0.15:
            kw["frequency_penalty"] = rng.choice([0.3, -0.3])
        if rng.random() < 0.2:
            kw["logit_bias"] = {t: rng.choice([-100.0, -5.0, 3.0, 100.0, 0.5]) for t in rng.sample(pool, 2)}
        if rng.random() < 0.2:
            kw["bad_words"] = [rng.sample(pool, rng.randint(1, 2)) for _ in range(rng.randint(1, 2))]
        if rng.random() < 0.3:
            kw["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.1:
            kw["prompt_logprobs"] = rng.randint(0, 3)
        r = Req(p, SamplingParams(**kw), 0 if i == 0 else rng.choice([0, rng.randint(1, 3), rng.randint(1, 8)]),
                rng.randint(0, 1))
        u = rng.random()
        if u < 0.1:
            r.abort_after = rng.randint(1, mt)
        elif u < 0.2 and chunk is not None:
            r.abort_prefill_at = r.join + rng.randint(0, 4)
        elif u < 0.45:
            r.stops = ("?",)  # a placeholder: chosen from the reference's text in `run_workload`
        reqs.append(r)
    return Workload(seed, mode, chunk, cache, cache_bytes, proposer, lazy, reqs)


def reference(env: Env, prompt: list[int], params: SamplingParams):
    key = (tuple(prompt), params)
    if key not in env.refs:
        eng = env.engine
        pc, eng.prefix_cache = eng.prefix_cache, None
        try:
            env.refs[key] = eng.generate([prompt], [params], "ar")[0]
        finally:
            eng.prefix_cache = pc
    return env.refs[key]


def _stop_sim(env: Env, ref_ids: list[int], stops, min_tokens: int):
    """The StopText of the reference's tokens fed one at a time (as mode "ar" emits them): (tokens used, text,
    stopped, the stop string matched)."""
    st = StopText(env.decode, stops, min_tokens=min_tokens)
    for t in ref_ids:
        if st.add([t]):
            break
    return st.generated, st.text, st.stopped, st.matched


def reference_scores(env: Env, prompt: list[int], params: SamplingParams, out: list[int]) -> torch.Tensor:
    """The reference's processed scores [V] for the token after prompt + out: one full forward, then the request's
    logits processing with `out` as its output so far."""
    eng = env.engine
    ids = prompt + out
    cache = eng.target.new_cache(1, len(ids) + 1)
    with torch.inference_mode():
        o = eng.target(torch.tensor([ids]), torch.arange(len(ids))[None], cache, len(ids),
                       logits_index=torch.tensor([[len(ids) - 1]]))
        r = eng._make_request(prompt, params)
        r.out = list(out)
        return r.scores(o.logits[0], [[]])[0]


def _logprob_problems(a, b, what: str, tol: float = LOGPROB_TOL) -> list[str]:
    """Differences between two lists of TokenLogprob beyond `tol` (top ids may swap only in near-ties)."""
    LOGPROB_TOL = tol  # noqa: N806
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            if (x is None) != (y is None):
                out.append(f"{what}[{i}]: {x} vs {y}")
            continue
        if x.token_id != y.token_id or abs(x.logprob - y.logprob) > LOGPROB_TOL or len(x.top) != len(y.top):
            out.append(f"{what}[{i}]: {x.token_id}:{x.logprob} vs {y.token_id}:{y.logprob}")
            continue
        for k, ((ti, vi), (tj, vj)) in enumerate(zip(x.top, y.top)):
            close = [v for _, v in x.top if abs(v - vi) <= LOGPROB_TOL]
            if abs(vi - vj) > LOGPROB_TOL or (ti != tj and len(close) < 2):
                out.append(f"{what}[{i}].top[{k}]: {(ti, vi)} vs {(tj, vj)}")
                break
    return out


def check_prefix_cache(pc: PrefixCache, stored: list) -> list[str]:
    """The tree's invariants: bytes within the bound and equal to its nodes', each node's K/V as long as its run,
    parents and child keys consistent, every held sequence matched whole with the K/V stored for it."""
    probs = []
    nodes = pc._nodes()
    total = sum(nd.nbytes for nd in nodes)
    if pc.nbytes != total:
        probs.append(f"prefix cache nbytes {pc.nbytes} != its nodes' {total}")
    if pc.nbytes > pc.max_bytes:
        probs.append(f"prefix cache holds {pc.nbytes} bytes > max_bytes {pc.max_bytes}")
    for nd in nodes:
        if nd.target.shape[3] != len(nd.tokens) or (nd.drafter is not None and nd.drafter.shape[3] != len(nd.tokens)):
            probs.append(f"node of {len(nd.tokens)} tokens holds K/V of {nd.target.shape[3]}")
        par = nd.parent
        if par is None or par.children.get(nd.tokens[0]) is not nd:
            probs.append("node not under its parent's key")
        if nd.drafter is not None and par is not pc._root and par.drafter is None:
            probs.append("drafter context on a node whose parent lacks it")
    for seq in pc.sequences():
        n, e = pc.match(seq + [0], False)
        if n != len(seq) or e.tokens.tolist() != seq:
            probs.append(f"held sequence of {len(seq)} tokens matched {n}")
            continue
        src = [(t, d) for toks, t, d in stored if toks[:n] == seq]
        if not src:
            probs.append(f"held sequence of {n} tokens was never stored")
            continue
        if not any(torch.allclose(e.target, t[:, :, :, :n], atol=1e-3, rtol=1e-3) for t, _ in src):
            probs.append(f"held sequence of {n} tokens: its target K/V are not what was stored")
        m, ed = pc.match(seq + [0], True)
        if m:
            dsrc = [d for toks, _, d in stored if d is not None and toks[:m] == seq[:m]]
            if not any(torch.allclose(ed.drafter, d[:, :, :, :m], atol=1e-3, rtol=1e-3) for d in dsrc):
                probs.append(f"held sequence's first {m} tokens: drafter context not what was stored")
    return probs


def _recording(pc: PrefixCache, stored: list) -> None:
    real = pc.store

    def store(tokens, target, drafter):
        stored.append((list(tokens), target.clone(), None if drafter is None else drafter.clone()))
        return real(tokens, target, drafter)

    pc.store = store


def run_workload(env: Env, wl: Workload, verbose: bool = False) -> tuple[list[str], list[str]]:
    """Run `wl` and check it: (bug reports, near-tie reports)."""
    eng = env.engine
    # the references first (no prefix cache, mode "ar", alone); stop strings from their text
    refs = [reference(env, r.prompt, r.params) for r in wl.reqs]
    rng = random.Random(wl.seed + 7919)
    for r, ref in zip(wl.reqs, refs):
        if r.stops:
            text = env.decode(ref.token_ids)
            if len(text) >= 2 and rng.random() < 0.8:
                a = rng.randrange(len(text) - 1)
                r.stops = (text[a : a + rng.randint(1, 3)],)
            else:
                r.stops = ("zq", "\n\n")
            r.stops = tuple(s for s in r.stops if s) or ("zq",)
    how = random.Random(wl.seed + 104729)  # its own stream: the stops drawn above stay those of earlier versions
    for r in wl.reqs:
        if r.stops and how.random() < 0.5:
            r.engine_stops, r.params = True, dataclasses.replace(r.params, stop=r.stops)
    # settings
    if eng.proposer is not None:
        for k, v in wl.proposer.items():
            setattr(eng.proposer, k, v)
    eng.lazy_logits = wl.lazy_logits
    stored: list = []
    if wl.cache == "off":
        pc = None
    elif wl.cache == "reuse" and env.pc is not None and env.pc_uses < 4:
        pc = env.pc
        env.pc_uses += 1
        stored = env.pc_stored
    else:
        pc = PrefixCache(wl.cache_bytes)
        _recording(pc, stored)
        env.pc, env.pc_uses, env.pc_stored = pc, 1, stored
    eng.prefix_cache = pc
    bugs, ties = [], []
    batch = DecodeBatch(eng, wl.mode, wl.chunk)
    texts = [StopText(env.decode, r.stops, min_tokens=r.params.min_tokens) if r.stops and not r.engine_stops else None
             for r in wl.reqs]
    counts = [0] * len(wl.reqs)
    ids: dict[int, int] = {}  # workload index -> request id

    def callback(members):
        def on_tokens(k, toks, *rest):
            i = members[k]
            counts[i] += len(toks)
            r = wl.reqs[i]
            if texts[i] is not None:
                return texts[i].add(toks)
            if r.abort_after is not None and counts[i] >= r.abort_after:
                return "abort"
            return None
        return on_tokens

    joins = sorted({(r.join, r.group) for r in wl.reqs})
    done: dict[int, object] = {}
    step = 0
    try:
        while step <= max(j for j, _ in joins) or batch.active:
            for j, g in joins:
                if j == step:
                    members = [i for i, r in enumerate(wl.reqs) if (r.join, r.group) == (j, g)]
                    got = batch.add([wl.reqs[i].prompt for i in members], [wl.reqs[i].params for i in members],
                                    callback(members))
                    ids.update(zip(members, got))
            aborts = [ids[i] for i, r in enumerate(wl.reqs) if r.abort_prefill_at == step and i in ids]
            if aborts:
                batch.abort_prefill(aborts)
            batch.step()
            done.update(batch.take_finished())
            step += 1
            if step > 2000:
                bugs.append("the batch did not finish in 2000 steps")
                break
        done.update(batch.take_finished())
    except Exception as exc:  # noqa: BLE001
        import traceback

        bugs.append(f"exception: {exc!r}\n{traceback.format_exc()}")
        return bugs, ties
    for i, (r, ref) in enumerate(zip(wl.reqs, refs)):
        tag = f"req {i} (prompt {len(r.prompt)} tok, join {r.join}, {r.params})"
        res = done.get(ids.get(i))
        if res is None:
            bugs.append(f"{tag}: no result")
            continue
        toks, rt = res.token_ids, ref.token_ids
        m = res.metrics
        for key, hit in (("requests", True), ("cached", m.cached_tokens > 0), ("aborted", res.finish_reason == "abort"),
                         ("stop string", texts[i] is not None and texts[i].stopped),
                         ("engine stop string", isinstance(res.stop_reason, str)), ("length", res.finish_reason == "length"),
                         ("stop", res.finish_reason == "stop"), ("drafted", m.accepted_tokens > 0),
                         ("context full", len(r.prompt) + len(toks) >= eng.context_len)):
            env.stats[key] = env.stats.get(key, 0) + hit
        if pc is None and m.cached_tokens:
            bugs.append(f"{tag}: cached_tokens {m.cached_tokens} without a prefix cache")
        if not 0 <= m.cached_tokens <= len(r.prompt) - 1:
            bugs.append(f"{tag}: cached_tokens {m.cached_tokens} for a prompt of {len(r.prompt)}")
        if r.params.prompt_logprobs is not None and m.cached_tokens:
            bugs.append(f"{tag}: prompt_logprobs request reused {m.cached_tokens} cached tokens")
        if m.completion_tokens != len(toks):
            bugs.append(f"{tag}: completion_tokens {m.completion_tokens} != {len(toks)}")
        if res.finish_reason == "abort":
            if r.abort_after is None and r.abort_prefill_at is None:
                bugs.append(f"{tag}: finish_reason abort without an abort")
            elif toks != rt[: len(toks)] or (r.abort_after is not None and len(toks) < r.abort_after):
                bugs.append(f"{tag}: aborted output {toks} vs the reference {rt}")
            elif r.abort_prefill_at is not None and toks:
                bugs.append(f"{tag}: aborted in its prefill with tokens {toks}")
            continue
        if texts[i] is not None:
            gen, text, stopped, _ = _stop_sim(env, rt, r.stops, r.params.min_tokens)
            st = texts[i]
            n_cmp = gen
            want_reason = "stop" if stopped else ref.finish_reason
            got_reason = "stop" if st.stopped else res.finish_reason
            if st.generated != gen or st.text != text:
                pass  # reported through the token mismatch below when that is the cause
        elif r.engine_stops:  # the engine cut the output itself: exactly the reference's tokens up to the stop string
            gen, text, stopped, matched = _stop_sim(env, rt, r.stops, r.params.min_tokens)
            n_cmp = gen
            want_reason = "stop" if stopped else ref.finish_reason
            got_reason = res.finish_reason
        else:
            n_cmp = len(rt)
            want_reason, got_reason = ref.finish_reason, res.finish_reason
        a, b = toks[:n_cmp], rt[:n_cmp]
        if len(toks) < n_cmp or a != b:
            k = next((x for x in range(min(len(a), len(b))) if a[x] != b[x]), None)
            if k is None:
                bugs.append(f"{tag}: {len(toks)} tokens {toks}, the reference {n_cmp}: {rt} ({res.finish_reason} vs "
                            f"{ref.finish_reason})")
                continue
            scores = reference_scores(env, r.prompt, r.params, rt[:k])
            top = scores.topk(2).values.tolist()
            gap = scores[b[k]].item() - scores[a[k]].item()
            msg = (f"{tag}: token {k}: {a[k]} vs reference {b[k]}; reference top-2 gap {top[0] - top[1]:.3g}, "
                   f"ref-vs-got gap {gap:.3g} [{wl.describe()}] cached={m.cached_tokens}")
            (ties if gap <= NEAR_TIE else bugs).append(msg)
            continue
        if texts[i] is not None and (texts[i].generated != gen or texts[i].text != text):
            bugs.append(f"{tag}: stop text {texts[i].text!r}/{texts[i].generated} vs {text!r}/{gen} ({r.stops})")
        # stop_reason: the stop string, else what the reference's ended it with (a stop token asked for, or None)
        if r.engine_stops and (res.text, len(toks), res.stop_reason) != (text, gen, matched if stopped else
                                                                         ref.stop_reason):
            bugs.append(f"{tag}: engine stop: text {res.text!r}, {len(toks)} tokens, stop_reason {res.stop_reason!r} vs "
                        f"{text!r}, {gen}, {matched!r} ({r.stops})")
        if got_reason != want_reason:
            bugs.append(f"{tag}: finish_reason {got_reason} vs reference {want_reason}; tokens {toks} / {rt}")
        if texts[i] is None and not r.engine_stops and r.abort_after is None and len(toks) != len(rt):
            bugs.append(f"{tag}: {len(toks)} tokens vs {len(rt)}")
        if r.params.logprobs is not None:
            if res.logprobs is None or len(res.logprobs) != len(toks):
                bugs.append(f"{tag}: {0 if res.logprobs is None else len(res.logprobs)} logprobs for {len(toks)} tokens")
            else:
                lp = (res.logprobs[:n_cmp], ref.logprobs[:n_cmp], "logprobs")
                bugs += [f"{tag}: {p}" for p in _logprob_problems(*lp, tol=LOGPROB_BUG)]
                ties += [f"{tag}: rounding {p}" for p in _logprob_problems(*lp)][:1]
        if r.params.prompt_logprobs is not None:
            if res.prompt_logprobs is None or len(res.prompt_logprobs) != len(r.prompt):
                bugs.append(f"{tag}: prompt_logprobs of length "
                            f"{None if res.prompt_logprobs is None else len(res.prompt_logprobs)} for {len(r.prompt)}")
            else:
                lp = (res.prompt_logprobs, ref.prompt_logprobs, "prompt_logprobs")
                bugs += [f"{tag}: {p}" for p in _logprob_problems(*lp, tol=LOGPROB_BUG)]
                ties += [f"{tag}: rounding {p}" for p in _logprob_problems(*lp)][:1]
        if m.prompt_tokens != len(r.prompt):
            bugs.append(f"{tag}: prompt_tokens {m.prompt_tokens} != {len(r.prompt)}")
    if pc is not None:
        try:
            bugs += check_prefix_cache(pc, stored)
        except Exception as exc:  # noqa: BLE001
            bugs.append(f"prefix cache check raised {exc!r}")
    if verbose:
        print(wl.describe(), "bugs", len(bugs), "ties", len(ties), flush=True)
    return [f"[{wl.describe()}] {b}" for b in bugs], ties


def tiny_env(tmp, name: str = "tiny") -> Env:
    """A tiny random llama (context 512, drafter block 4) or, for "tiny-small", a qwen3 of context 64 whose drafter
    (block 8) sees only 40 positions (drafting stops there)."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.models.checkpoints import init_drafter, load_drafter, load_target, new_drafter_config
    from dflash_trt.runtime.proposer import DFlashProposer
    from tests.conftest import make_hf_model

    if name == "tiny":
        _, folder = make_hf_model(tmp, "llama", vocab=96, seed=7)
        dcfg = new_drafter_config(TargetConfig.from_pretrained(folder), 1, 4, 95, [1, 3])
    else:
        _, folder = make_hf_model(tmp, "qwen3", vocab=80, seed=3, max_position_embeddings=64)
        dcfg = new_drafter_config(TargetConfig.from_pretrained(folder), 1, 8, 79, [0, 2])
        dcfg = dataclasses.replace(dcfg, max_position_embeddings=40)
    target = load_target(folder)
    drafter = load_drafter(init_drafter(dcfg, tmp / f"d-{name}", seed=2))
    eng = Engine(target, DFlashProposer(drafter, target))
    eng.detokenize = decode = lambda ids: "".join(chr(97 + t % 26) for t in ids)  # params.stop
    return Env(name, eng, decode)


def smollm2_env(pipeline=None) -> Env:
    from dflash_trt.api import load_pipeline

    p = pipeline or load_pipeline(dtype="float32", draft_confidence=0.0, tree_topk=1, prompt_lookup=0,
                                  max_concurrency=None)
    tok = p.tokenizer
    return Env("smollm2", p.engine, lambda ids: tok.decode(ids, skip_special_tokens=True), p.encode)


def main() -> None:
    import argparse
    import tempfile
    import time
    from pathlib import Path

    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="tiny", choices=["tiny", "tiny-small", "smollm2"])
    ap.add_argument("--seeds", default="0:20")
    ap.add_argument("--budget", type=float, default=1e9, help="stop after this many seconds")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lo, hi = map(int, args.seeds.split(":"))
    with tempfile.TemporaryDirectory(prefix="scheduler-fuzz-") as tmp:
        env = smollm2_env() if args.env == "smollm2" else tiny_env(Path(tmp), args.env)
        t0, n, nb, nt = time.time(), 0, 0, 0
        for seed in range(lo, hi):
            if time.time() - t0 > args.budget:
                break
            wl = make_workload(env, seed)
            bugs, ties = run_workload(env, wl)
            n += 1
            nb += len(bugs)
            nt += len(ties)
            for b in bugs:
                print("BUG", b, flush=True)
            for t in ties:
                print("TIE", t, flush=True)
        print(f"{args.env}: {n} workloads (seeds {lo}..{lo + n - 1}), {nb} bugs, {nt} near-ties, "
              f"{time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
