"""Guided decoding (a JSON schema, any JSON object, a regex, an EBNF grammar) is exact under speculative decoding:
each verify position is masked by the grammar after its own history (output + the drafts before it), so DFlash
(chains and trees) gives Hugging Face `generate`'s greedy tokens with XGrammar's own logits processor, and keeps
the masked distribution when sampling; a mask that forgets the drafts is caught by the same tests."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import sys
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

import dflash_trt.runtime.engine as engine_mod
from dflash_trt.errors import ConfigError, InvalidRequestError
from dflash_trt.runtime.engine import Engine
from dflash_trt.runtime.guided import (MAX_SCHEMA_DEPTH, Grammars, GuidedDecoding, GuidedLogits, apply_bitmask,
                                       require_xgrammar)
from dflash_trt.runtime.proposer import DFlashProposer
from dflash_trt.runtime.sampling import SamplingParams
from tests.runtime.oracle import OracleProposer
from tests.runtime.test_sampling_distribution import (  # noqa: F401 (tiny: a fixture)
    PROMPT, VOCAB, N, exact_joint, scaled_pvalue_and_rate, tiny)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "languages": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
PERSON = "Describe a programmer named Ada, aged 36, as JSON."
MAX_TOKENS = 48


@pytest.mark.parametrize("kw, message", [
    ({}, "exactly one of json (a JSON schema), json_object, regex, grammar; got none"),
    ({"regex": "a", "json_object": True}, "got ['regex', 'json_object']"),
    ({"json": "{not json"}, "the JSON schema is not JSON"),
    ({"json": "[1]"}, "a JSON schema is an object (or true: any JSON value), got [1]"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"json_object": 1}, "json_object must be True or False"),
    ({"regex": "a\ud800"}, ("the regex holds an unpaired surrogate (U+D800) at character 2, which is not a character; "
                             "send valid Unicode text")),  # a JSON request's "\ud800": XGrammar's UnicodeEncodeError
    ({"grammar": 'root ::= "\udcff"'}, "the grammar holds an unpaired surrogate (U+DCFF) at character 11"),
    ({"json": '{"enum": ["\udcff"]}'}, "the json holds an unpaired surrogate (U+DCFF) at character 12"),
])
def test_a_bad_specification_is_named(kw, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        GuidedDecoding(**kw)


def test_specifications_keep_their_schema_order_and_refuse_what_cannot_end(smollm2_pipeline):
    spec = GuidedDecoding(json={"b": 1, "a": 2})
    assert spec.json == '{"b": 1, "a": 2}' and spec.kind == "json" and hash(spec) == hash(GuidedDecoding(json=spec.json))
    with pytest.raises(InvalidRequestError, match="min_tokens and guided decoding do not go together"):
        SamplingParams(min_tokens=2, guided=GuidedDecoding(json_object=True))
    with pytest.raises(InvalidRequestError, match="ignore_eos and guided decoding do not go together"):
        SamplingParams(ignore_eos=True, guided=GuidedDecoding(json_object=True))
    with pytest.raises(InvalidRequestError, match="the regex does not compile: Regex parsing error at position 4"):
        smollm2_pipeline.engine.generate([[1, 2]], SamplingParams(guided=GuidedDecoding(regex="(ab")))
    with pytest.raises(InvalidRequestError, match="the grammar does not compile"):
        smollm2_pipeline.engine.generate([[1, 2]], SamplingParams(guided=GuidedDecoding(grammar="root ::= undefined")))


@pytest.mark.parametrize("schema, message", [
    ({"allOf": [{"type": "object"}]}, "the JSON schema keyword 'allOf' (at #) is not supported"),
    ({"type": "array", "items": {"not": {"type": "string"}}}, "keyword 'not' (at #/items) is not supported"),
    ({"type": "array", "uniqueItems": True}, "keyword 'uniqueItems' (at #)"),
    ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, "keyword 'if' (at #/properties/a)"),
    ({"$ref": "http://example.com/s.json"}, "$ref 'http://example.com/s.json' (at #) points outside the schema"),
    ({"type": "object", "properties": {}, "required": ["zz"], "additionalProperties": False},
     "requires ['zz'] (at #), which additionalProperties: false forbids"),
    ("false", "a JSON schema is an object (or true: any JSON value), got false"),
])
def test_schemas_xgrammar_would_not_enforce_are_refused(schema, message):
    """A keyword XGrammar accepts but does not hold the output to (it returned a number for an allOf of objects),
    a remote $ref (read as "any value"), and a schema nothing satisfies (whitespace until max_tokens) are refused
    by name; a property that happens to be called "not", local $refs and recursion pass."""
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        GuidedDecoding(json=schema)
    GuidedDecoding(json={"type": "object", "properties": {"not": {"type": "string"}, "if": {"$ref": "#/$defs/n"}},
                         "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}})


def test_a_schema_nested_too_deeply_is_refused():
    schema = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"type": "object", "properties": {"a": schema}}
    GuidedDecoding(json=schema)
    with pytest.raises(InvalidRequestError, match=f"nests more than {MAX_SCHEMA_DEPTH} levels deep"):
        GuidedDecoding(json={"type": "array", "items": schema})


class SlowCompiler:
    """A stand-in for XGrammar's compiler: compile_regex("slow") waits for `release`."""

    def __init__(self):
        self.release, self.started = threading.Event(), threading.Event()

    def compile_regex(self, regex):
        if regex == "slow":
            self.started.set()
            assert self.release.wait(10)
        return f"compiled {regex}"


def test_a_slow_compile_holds_up_neither_cached_grammars_nor_other_compiles(monkeypatch):
    """While one request's grammar compiles, a cached one is handed out and another compiles (the generation
    thread asks for its requests' grammars: a 400-level schema had stopped every stream for 20 s); the cache keeps
    the CACHE_SIZE most recently used."""
    import dflash_trt.runtime.guided as guided_mod

    monkeypatch.setattr(guided_mod, "CACHE_SIZE", 2)
    grammars = Grammars(None, 10)
    grammars._compiler = compiler = SlowCompiler()
    assert grammars.compile(GuidedDecoding(regex="a")) == "compiled a"
    slow = threading.Thread(target=grammars.compile, args=(GuidedDecoding(regex="slow"),))
    slow.start()
    assert compiler.started.wait(10)
    assert grammars.compile(GuidedDecoding(regex="a")) == "compiled a"  # cached, while "slow" compiles
    assert grammars.compile(GuidedDecoding(regex="b")) == "compiled b"  # another compile, meanwhile
    compiler.release.set()
    slow.join(10)
    assert list(grammars._compiled) == [GuidedDecoding(regex="b"), GuidedDecoding(regex="slow")]  # "a" dropped


def test_a_missing_xgrammar_is_a_config_error_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ConfigError, match="needs XGrammar: pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi"):
        require_xgrammar()


def test_each_row_is_masked_after_its_own_history(smollm2_pipeline):
    """`mask` over chain prefixes equals a fresh matcher's mask after out + that prefix, row by row; a row after a
    draft the grammar forbids is left as it is; the matcher is back at `out` afterwards (the same call again
    gives the same rows)."""
    xgr = require_xgrammar()
    pipe = smollm2_pipeline
    compiled = pipe.engine.grammars.compile(GuidedDecoding(json=SCHEMA))
    vocab, stops = pipe.engine.target.config.vocab_size, frozenset(pipe.engine.eos_token_ids)
    tokens = pipe.tokenizer.encode('{"name": "Ada", "age": 36', add_special_tokens=False)
    out, drafts = tokens[:3], tokens[3:9]
    bad = pipe.engine.eos_token_ids[0]  # the stop token inside a JSON object: the grammar forbids it
    prefixes = [drafts[:i] for i in range(len(drafts) + 1)] + [drafts[:2] + [bad], drafts[:2] + [bad, drafts[2]]]
    logits = torch.randn(len(prefixes), vocab, generator=torch.Generator().manual_seed(0))
    guided = GuidedLogits(compiled, stops, vocab)
    masked = guided.mask(logits.clone(), out, prefixes)
    assert torch.equal(guided.mask(logits.clone(), out, prefixes), masked)
    forbidden = []
    for i, pre in enumerate(prefixes):
        fresh = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stops))
        if all(fresh.accept_token(t) for t in out + pre):
            bitmask = xgr.allocate_token_bitmask(1, vocab)
            fresh.fill_next_token_bitmask(bitmask)
            want = logits[i : i + 1].clone()
            xgr.apply_token_bitmask_inplace(want, bitmask)
            assert torch.equal(masked[i], want[0]), i
            forbidden.append(int(torch.isinf(masked[i]).sum()))
        else:
            assert i >= len(drafts) + 1 and torch.equal(masked[i], logits[i])  # the rows after `bad`
    assert len(forbidden) == len(drafts) + 1 and min(forbidden) > 0 and max(forbidden) > vocab // 2  # real masks


def test_the_torch_bitmask_equals_xgrammars_kernel():
    """`apply_bitmask` (what GPUs use) masks exactly as XGrammar's CPU kernel, a vocabulary that is not a multiple
    of 32 included."""
    xgr = require_xgrammar()
    gen = torch.Generator().manual_seed(3)
    for vocab in (49152, 1000):
        bitmask = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
        logits = torch.randn(5, vocab, generator=gen)
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask)
        assert torch.equal(apply_bitmask(logits.clone(), bitmask), want)
        assert 0.3 < torch.isinf(want).float().mean() < 0.7


# ------------------------------------------------------------------------- greedy: Hugging Face's tokens

@pytest.fixture(scope="module")
def hf_target(smollm2_path):
    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


SPECS = {
    "json-schema": GuidedDecoding(json=SCHEMA),
    "json-object": GuidedDecoding(json_object=True),
    "regex": GuidedDecoding(regex=r"Ada is [0-9]+ years old and knows (Python|C|Rust)\."),
    "grammar": GuidedDecoding(grammar='root ::= "Name: " [A-Z] [a-z]+ "\\nAge: " [0-9]+ "\\n"'),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SPECS))
def test_greedy_dflash_chains_trees_and_ar_give_hf_generate_tokens(smollm2_pipeline, hf_target, case):
    import xgrammar.contrib.hf as xgr_hf

    pipe = smollm2_pipeline
    spec = SPECS[case]
    params = SamplingParams(max_tokens=MAX_TOKENS, guided=spec)
    eos = list(pipe.engine.eos_token_ids)
    prompt = pipe.encode_chat(PERSON)
    ids = torch.tensor([prompt])
    processor = xgr_hf.LogitsProcessor(pipe.engine.grammars.compile(spec))
    ref = hf_target.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                             logits_processor=[processor])[0, len(prompt):].tolist()
    plain = hf_target.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos,
                               pad_token_id=eos[0])[0, len(prompt):].tolist()
    assert ref != plain  # the grammar changes the answer
    tree = Engine(pipe.engine.target, DFlashProposer(pipe.engine.proposer.drafter, pipe.engine.target, tree_topk=4),
                  pipe.engine.eos_token_ids)
    tree.grammars = pipe.engine.grammars
    accepted = 0
    for engine, mode in [(pipe.engine, "dflash"), (tree, "dflash"), (pipe.engine, "ar")]:
        [res] = engine.generate([prompt], params, mode)
        assert res.token_ids == ref, (mode, engine is tree)
        accepted += res.metrics.accepted_tokens if mode == "dflash" else 0
    assert accepted > 0  # drafts were verified under the grammar
    if case == "json-schema" and res.finish_reason == "stop":
        value = json.loads(pipe.decode(ref))
        assert set(value) == {"name", "age", "languages"} and isinstance(value["age"], int)


@pytest.fixture(scope="module")
def oracle_case(smollm2_pipeline):
    """(engine with an oracle drafting the guided greedy answer in blocks of 8, prompt, params, that answer)."""
    pipe = smollm2_pipeline
    prompt = pipe.encode_chat(PERSON)
    params = SamplingParams(max_tokens=32, guided=GuidedDecoding(json=SCHEMA))
    ref = pipe.engine.generate([prompt], params, "ar")[0].token_ids
    engine = Engine(pipe.engine.target, OracleProposer([prompt + ref], 8), pipe.engine.eos_token_ids)
    engine.grammars = pipe.engine.grammars
    return engine, prompt, params, ref


def test_an_oracle_drafting_the_guided_answer_is_accepted_whole(oracle_case):
    """Drafts equal to the guided answer are all accepted: position i's mask follows the i drafts before it."""
    engine, prompt, params, ref = oracle_case
    res = engine.generate([prompt], params, "dflash")[0]
    assert res.token_ids == ref and res.metrics.accepted_tokens == len(ref) - res.metrics.verify_steps


def test_a_mask_that_forgets_the_drafts_is_caught(oracle_case, monkeypatch):
    """The same run with every position masked as the block's first one emits a token the grammar forbids
    (the matcher, kept in step with the output, stops it there)."""
    engine, prompt, params, ref = oracle_case
    monkeypatch.setattr(engine_mod, "tree_prefixes", lambda tokens, parents, nodes: [[] for _ in range(nodes)])
    with pytest.raises(RuntimeError, match="guided decoding: the output token .* breaks the grammar"):
        engine.generate([prompt], params, "dflash")


# --------------------------------------------------------------------------- sampling: the distribution

#: the tiny target's 6 tokens as text (token 5 its stop token), and a grammar whose masks depend on the history:
#: first a or b; after a: c or d, after b: a or e; then a, c or e
TINY_TOKENS = ["a", "b", "c", "d", "e", "</s>"]
TINY_GRAMMAR = GuidedDecoding(regex="(a(c|d)|b(a|e))(a|c|e)")
TINY_PARAMS = SamplingParams(temperature=1.0, max_tokens=3, stop_token_ids=(5,), guided=TINY_GRAMMAR)


def tiny_engine(tiny, sample_drafts=True) -> Engine:
    xgr = require_xgrammar()
    target, drafter = tiny
    engine = Engine(target, DFlashProposer(drafter, target, sample_drafts=sample_drafts))
    engine.grammars = Grammars(None, VOCAB)
    engine.grammars._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(TINY_TOKENS, stop_token_ids=[5]))
    return engine


def guided_pvalue(engine) -> tuple[float, int, float]:
    """(chi-square p-value of N seeded DFlash samples against the exact joint under the grammar, samples the grammar
    forbids, acceptance rate)."""
    xgr = require_xgrammar()
    compiled = engine.grammars.compile(TINY_GRAMMAR)

    def masked(ids, logits):  # the reference: a fresh matcher on the history after the prompt
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[5])
        if not all(matcher.accept_token(t) for t in ids[0, len(PROMPT):].tolist()):
            return torch.full_like(logits, float("-inf")).index_fill_(1, torch.tensor([5]), 0.0)  # never reached
        bitmask = xgr.allocate_token_bitmask(1, VOCAB)
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        return logits

    results = engine.generate([PROMPT] * N, [dataclasses.replace(TINY_PARAMS, seed=i) for i in range(N)], "dflash")
    counts = dict.fromkeys(itertools.product(range(VOCAB), repeat=3), 0)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    with torch.no_grad():
        joint = exact_joint(engine.target, TINY_PARAMS, masked)
    possible = [k for k, pk in joint.items() if pk > 0]
    assert len(possible) == 12  # the grammar's 12 three-token outputs
    impossible = sum(counts[k] for k, pk in joint.items() if pk == 0)
    p, rate = scaled_pvalue_and_rate([counts[k] for k in possible], [joint[k] * N for k in possible], results)
    return p, impossible, rate


@pytest.mark.parametrize("sample_drafts", [True, False], ids=["sampled-drafts", "argmax-drafts"])
def test_dflash_sampling_keeps_the_masked_distribution(tiny, sample_drafts):
    p, impossible, rate = guided_pvalue(tiny_engine(tiny, sample_drafts))
    assert 0.01 < rate < 0.95  # drafts are accepted and rejected: both verifier paths run
    assert impossible == 0 and p > 0.001


def test_a_grammar_with_no_way_on_is_a_request_error(tiny):
    """"az" over a vocabulary without "z": after "a" the grammar allows nothing, which is an error naming the dead
    end, not an arbitrary token."""
    engine = tiny_engine(tiny)
    params = SamplingParams(max_tokens=3, stop_token_ids=(5,), guided=GuidedDecoding(regex="az"))
    for mode in ("ar", "dflash"):
        with pytest.raises(InvalidRequestError, match=r"the grammar allows no token after the output so far \(1 "):
            engine.generate([PROMPT], params, mode)


def test_sampling_with_a_mask_that_forgets_the_drafts_fails_the_same_test(tiny, monkeypatch):
    monkeypatch.setattr(engine_mod, "chain_prefixes", lambda drafts, first, end: [[] for _ in range(first, end)])
    p, impossible, _ = guided_pvalue(tiny_engine(tiny))
    assert impossible > 0 or p < 1e-6


def test_a_compile_failure_of_the_machine_is_not_the_requests(smollm2_pipeline, monkeypatch):
    """XGrammar raises RuntimeError both for a schema that does not parse (its message carries a "[time] file:line:"
    prefix) and for a failure of the system, e.g. EAGAIN when a thread cannot start on a loaded machine: the server
    answered that with a 400 saying the JSON does not compile. It is a DFlashError (a 500), the request not blamed."""
    from dflash_trt.errors import DFlashError

    grammars = smollm2_pipeline.engine.grammars
    grammars.compile(GuidedDecoding(regex="(a|b)"))  # the compiler exists
    compiler = grammars._compiler

    class Failing:
        def compile_regex(self, regex):
            raise RuntimeError("Resource temporarily unavailable")

    monkeypatch.setattr(grammars, "_compiler", Failing())
    with pytest.raises(DFlashError, match=r"compiling the regex failed on this machine \(Resource temporarily "
                                          r"unavailable\); the request itself may be fine: retry it") as info:
        grammars.compile(GuidedDecoding(regex="(c|d)"))
    assert not isinstance(info.value, InvalidRequestError)
    monkeypatch.setattr(grammars, "_compiler", compiler)
    with pytest.raises(InvalidRequestError, match="the regex does not compile"):
        grammars.compile(GuidedDecoding(regex="(c|d"))
