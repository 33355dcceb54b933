"""Guided decoding (structured output): the target's tokens follow a JSON schema, any JSON object, a regular
expression or an EBNF grammar, under speculation, exactly.

A grammar masks the target's logits by what the output holds so far: under speculative decoding each verify
position needs its OWN history (the output before this step, then the drafts before that position in the
block, or on its tree path), as the penalties do (`dflash_trt.runtime.penalties`). `GuidedLogits.mask`
walks one grammar matcher along each position's history (accepting tokens, rolling back to the history the
next position shares), fills that position's token bitmask, and sets the logits of the tokens the grammar
forbids there to -inf. The verifier then keeps exactly what autoregressive decoding with the same grammar
would: a draft the grammar forbids is rejected at its position (its masked logit is -inf), and the positions
after it are never used (their rows are left unmasked).

The grammar engine is XGrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation
Engine for Large Language Models"; the `xgrammar` package, TensorRT-LLM's and vLLM's default backend),
imported when a request first asks for a grammar. The specification names are TensorRT-LLM's
`GuidedDecodingParams` (json, json_object, regex, grammar).
"""

from __future__ import annotations

import json as json_module
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from dflash_trt.errors import ConfigError, DFlashError, InvalidRequestError
from dflash_trt.text import invalid_unicode


@dataclass(frozen=True)
class GuidedDecoding:
    """What the output must follow: exactly one of

    json: a JSON schema (its JSON text, or a dict, stored as JSON text in its key order): the output is a JSON
        value that the schema accepts (`check_schema`: the keywords XGrammar does not enforce are refused; an object
        without `additionalProperties` takes only its `properties`, XGrammar's strict mode, as in vLLM; at most
        MAX_WHITESPACE whitespace characters between tokens). json_object: True: any JSON object. regex: a regular expression the whole output
        matches. grammar: an EBNF grammar (XGrammar's / llama.cpp's GBNF dialect, its start rule `root`).

    The output ends at the request's stop token once the grammar is complete (a grammar that can go on
    lets the model choose). Hashable (the SamplingParams holding it stay so).

    Raises:
        InvalidRequestError: none or several set, a wrong type, text holding a lone surrogate (not UTF-8 text:
            `dflash_trt.text.invalid_unicode`), a schema that is not JSON, or one `check_schema` refuses.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self):
        if isinstance(self.json, dict):
            check_nesting(self.json)  # before anything recursive reads it
            object.__setattr__(self, "json", json_module.dumps(self.json))  # key order kept: properties come in it
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidRequestError(f"guided decoding: {name} must be a non-empty string, got {value!r}")
            problem = None if value is None else invalid_unicode(value)
            if problem:  # XGrammar would fail encoding it to UTF-8
                raise InvalidRequestError(f"guided decoding: the {name} holds {problem}; send valid Unicode text")
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(f"guided decoding: json_object must be True or False, got {self.json_object!r}")
        given = [n for n in ("json", "regex", "grammar") if getattr(self, n) is not None] + (
            ["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise InvalidRequestError("guided decoding takes exactly one of json (a JSON schema), json_object, regex, "
                                      f"grammar; got {given or 'none'}")
        if self.json is not None:
            try:
                schema = json_module.loads(self.json)
            except ValueError as exc:
                raise InvalidRequestError(f"guided decoding: the JSON schema is not JSON ({exc})") from None
            except RecursionError:
                raise InvalidRequestError(f"guided decoding: the JSON schema nests more than {MAX_JSON_DEPTH} levels "
                                          "of objects and arrays; flatten it or use $defs and $ref") from None
            check_nesting(schema)
            if not isinstance(schema, (dict, bool)) or schema is False:
                raise InvalidRequestError("guided decoding: a JSON schema is an object (or true: any JSON value), got "
                                          f"{json_module.dumps(schema)[:80]}")
            check_schema(schema)

    @property
    def kind(self) -> str:
        """Which of the four it is: "json", "json_object", "regex" or "grammar"."""
        return "json_object" if self.json_object else next(n for n in ("json", "regex", "grammar")
                                                          if getattr(self, n) is not None)


#: JSON Schema keywords XGrammar 0.2.9 accepts but does not enforce (outputs could break them: allOf, not,
#: if / then / else, uniqueItems, dependentRequired) or enforces wrongly (contains, patternProperties refuse
#: valid JSON): refused by `check_schema`, naming the keyword, rather than silently ignored
UNENFORCED = ("allOf", "not", "if", "then", "else", "uniqueItems", "dependentRequired", "dependentSchemas",
              "dependencies", "contains", "minContains", "maxContains", "patternProperties", "propertyNames",
              "unevaluatedProperties", "unevaluatedItems")
#: how deeply a JSON schema may nest (XGrammar's compile time grows fast with depth: 400 levels took 11 s)
MAX_SCHEMA_DEPTH = 32
#: how deeply a schema's JSON may nest in all, any key (a subschema is at least two levels: "properties" -> name)
MAX_JSON_DEPTH = 4 * MAX_SCHEMA_DEPTH
#: whitespace characters XGrammar allows between two JSON tokens (unbounded, a model can emit only spaces and
#: newlines until max_tokens)
MAX_WHITESPACE = 16
#: compiled grammars kept (least recently used dropped first: each holds ~0.7 MB for a 20-property schema)
CACHE_SIZE = 128

_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # name -> schema
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "contains", "if", "then", "else",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def check_nesting(value, limit: int = MAX_JSON_DEPTH, what: str = "guided decoding: the JSON schema",
                  hint: str = "flatten it or use $defs and $ref", param: str | None = None) -> None:
    """Raises InvalidRequestError (`param`) when JSON data (dicts, lists) nests more than `limit` levels, whatever the
    keys: "{what} nests more than {limit} levels of objects and arrays; {hint}". Walked without recursion: what
    reads the data later recursively (json.dumps, a schema's walk) would overflow Python's stack."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            raise InvalidRequestError(f"{what} nests more than {limit} levels of objects and arrays; {hint}",
                                      param=param)
        stack.extend((child, depth + 1) for child in children)


def check_schema(schema, depth: int = 0, where: str = "#") -> None:
    """Refuse what XGrammar would not hold an output to: a keyword of UNENFORCED, a `$ref` outside the schema (not
    "#..."), nesting deeper than MAX_SCHEMA_DEPTH, or an object whose `required` names a property that
    `additionalProperties: false` forbids (nothing could satisfy it). `where` is the JSON pointer shown.

    Raises:
        InvalidRequestError: naming the keyword and where it is.
    """
    if depth > MAX_SCHEMA_DEPTH:
        shown = where if len(where) <= 120 else where[:60] + " ... " + where[-55:]
        raise InvalidRequestError(f"guided decoding: the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep "
                                  f"(at {shown}); flatten it or use $defs and $ref")
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in UNENFORCED:
            raise InvalidRequestError(f"guided decoding: the JSON schema keyword {key!r} (at {where}) is not supported "
                                      "(XGrammar would not enforce it); rewrite the schema without it")
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise InvalidRequestError(f"guided decoding: $ref {value!r} (at {where}) points outside the schema; only "
                                      "local references (#/$defs/...) are supported: inline the referenced schema")
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, depth + 1, f"{where}/{key}/{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, depth + 1, f"{where}/{key}/{i}")
        elif key in _SCHEMA_ONE:
            check_schema(value, depth + 1, f"{where}/{key}")
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if schema.get("additionalProperties") is False and isinstance(schema.get("required"), list):
        missing = [name for name in schema["required"] if name not in props]
        if missing:
            raise InvalidRequestError(f"guided decoding: the JSON schema requires {missing} (at {where}), which "
                                      "additionalProperties: false forbids; add them to properties")


def require_xgrammar():
    """The `xgrammar` module.

    Raises:
        ConfigError: it is not installed, with the install command.
    """
    try:
        import xgrammar
    except ImportError as exc:
        raise ConfigError("guided decoding (response_format, a JSON schema, a regex, a grammar) needs XGrammar: "
                          f"pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi ({exc})") from None
    return xgrammar


class Grammars:
    """Compiles guided-decoding specifications for one target's tokenizer (XGrammar's `GrammarCompiler`, built on
    first use: its tokenizer table costs ~0.3 s on SmolLM2), caching each specification's compiled grammar.

    Args:
        tokenizer: the target's Hugging Face tokenizer.
        vocab_size: the target's vocab_size (the logits' width; may exceed the tokenizer's length).
        stop_token_ids: the target's EOS ids (a grammar's default stop tokens; a request's own stop tokens
            replace them in its matcher, `GuidedLogits`), or () for the tokenizer's.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...] = ()):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids) or None
        self._compiler = None
        self._compiled: OrderedDict[GuidedDecoding, object] = OrderedDict()  # CACHE_SIZE at most, LRU
        # guards the compiler's creation and the cache, never a compile: a slow schema holds up neither the
        # generation thread (whose requests' grammars the server compiled first) nor other requests' compiles
        self._lock = threading.Lock()

    def compile(self, spec: GuidedDecoding):
        """The compiled grammar of `spec` (XGrammar's `CompiledGrammar`).

        Raises:
            ConfigError: xgrammar is missing. InvalidRequestError: the schema, regex or grammar does not compile
                (XGrammar's message). DFlashError: compiling failed for a reason of the machine's (XGrammar's
                error without its parse-error prefix, e.g. "Resource temporarily unavailable": no thread could
                start), which the server answers with a 500, not a 400 blaming the request.
        """
        xgr = require_xgrammar()
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # the LRU here is the cache
            compiler = self._compiler
        try:  # outside the lock (XGrammar's compiler is thread-safe)
            if spec.kind in ("json", "json_object"):  # json_object: an object (OpenAI's JSON mode), not any value
                compiled = compiler.compile_json_schema(spec.json if spec.kind == "json" else '{"type": "object"}',
                                                        max_whitespace_cnt=MAX_WHITESPACE)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.regex)
            else:
                compiled = compiler.compile_grammar(spec.grammar)
        except RuntimeError as exc:  # XGrammar's parse errors: "[time] file.cc:line: message"
            raw = str(exc).strip()
            message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", raw)
            if message == raw:  # no log prefix: not a parse error but the system's (a thread it could not start)
                raise DFlashError(f"guided decoding: compiling the {spec.kind} failed on this machine ({raw}); the "
                                  "request itself may be fine: retry it") from exc
            raise InvalidRequestError(f"guided decoding: the {spec.kind} does not compile: {message}") from None
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled


class GuidedLogits:
    """One request's grammar matcher, kept in step with its output.

    Args:
        compiled: `Grammars.compile`'s result.
        stop_ids: the request's stop tokens: what the grammar allows once it is complete.
        vocab_size: the logits' width.
    """

    def __init__(self, compiled, stop_ids: frozenset[int], vocab_size: int):
        xgr = require_xgrammar()
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids))
        self.vocab_size = vocab_size
        self.synced = 0  # tokens of the output the matcher has accepted

    def _sync(self, out: list[int]) -> None:
        for tok in out[self.synced :]:
            if not self.matcher.accept_token(tok):  # the output itself broke the grammar: a bug, not a request error
                raise RuntimeError(f"guided decoding: the output token {tok} at {self.synced} breaks the grammar")
            self.synced += 1

    def mask(self, scores: torch.Tensor, out: list[int], prefixes: list[list[int]]) -> torch.Tensor:
        """Set the logits the grammar forbids to -inf, in place, row i after history `out` + prefixes[i].

        Args:
            scores: [m, V] float32 logits, row i at position i (any device).
            out: the tokens the request has emitted before this step.
            prefixes: m lists: the drafts between `out` and row i's prediction.
        Returns:
            `scores`. A row whose history the grammar forbids (a draft it rejects; such a position is never
            reached) is left as it is.
        Raises:
            InvalidRequestError: the grammar allows no token after `out` itself (a dead end).
        """
        self._sync(out)
        m = scores.shape[0]
        bitmask = self._xgr.allocate_token_bitmask(m, self.vocab_size)  # every token allowed
        path: list[int] = []  # drafts the matcher holds beyond `out`
        for i, pre in enumerate(prefixes):
            shared = 0
            while shared < min(len(path), len(pre)) and path[shared] == pre[shared]:
                shared += 1
            if len(path) > shared:
                self.matcher.rollback(len(path) - shared)
                del path[shared:]
            reachable = True
            for tok in pre[shared:]:
                if self.matcher.is_terminated() or not self.matcher.accept_token(tok):
                    reachable = False
                    break
                path.append(tok)
            if reachable and not self.matcher.is_terminated():
                self.matcher.fill_next_token_bitmask(bitmask, i)
                if not pre and not bool(bitmask[i].any()):  # the output itself can go on with no token
                    self.matcher.rollback(len(path))
                    raise InvalidRequestError("guided decoding: the grammar allows no token after the output so far "
                                              f"({len(out)} tokens): it cannot be completed (a JSON schema no value "
                                              "satisfies?); fix the schema, regex or grammar")
        if path:
            self.matcher.rollback(len(path))
        if scores.device.type == "cpu":
            self._xgr.apply_token_bitmask_inplace(scores, bitmask)  # XGrammar's CPU kernel
        else:
            apply_bitmask(scores, bitmask.to(scores.device))
        return scores


def apply_bitmask(scores: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set scores[i, t] to -inf where bit t of row i of `bitmask` is 0, in place, with torch operations only (any
    device: XGrammar's own GPU kernels need the `triton` package, which this project does not install).

    Args:
        scores: [m, V] float logits. bitmask: [m, ceil(V / 32)] int32, bit t % 32 of word t // 32 = token t allowed
            (XGrammar's layout).
    Returns:
        `scores`.
    """
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, : scores.shape[1]]
    return scores.masked_fill_(allowed == 0, float("-inf"))
