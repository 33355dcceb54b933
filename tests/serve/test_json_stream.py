"""JSON read from a growing text (`dflash_trt.serve.json_stream`): however the text is cut, what is sure only grows
and the whole value is written as `json.dumps` writes it; the reader stops where the text stops being JSON."""

from __future__ import annotations

import json
import re

import pytest

from dflash_trt.serve.json_stream import JsonReader, NotJson


def canonical(text: str) -> str:
    """json.dumps(..., ensure_ascii=False) of the value `text` is, its lone surrogates escaped (UTF-8 cannot carry
    them)."""
    return re.sub("[\ud800-\udfff]", lambda m: f"\\u{ord(m.group()):04x}",
                  json.dumps(json.loads(text), ensure_ascii=False))


@pytest.mark.parametrize("text", [
    '{"a": 1}',
    '{"a":[1,2.50,-0,1E2,-0.0,true,false,null,{},[]],"b":{"c":"x\\"y\\\\z\\/\\n\\t\\b\\f\\r\\u00e9\\u0001"}}',
    ' {"s": "café \u2028 ok 😀", "n": -12.5e-3 , "e": [ ] }\n',
    '{"pair": "\\ud83d\\ude00", "lone": "\\ud83dabc", "upper": "\\uD83D\\uDE00", "end": "\\ud800"}',
    '[1, "a", [], {"k": null}]', "123", '"str"', "true",
])
def test_json_reader_writes_what_json_dumps_writes_however_cut(text):
    want = canonical(text)
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            r = JsonReader()
            sure = []
            for end in (a, b):
                r.read(text[:end])
                sure.append(r.out)
            r.read(text, final=True)
            assert r.done and r.out == want and all(want.startswith(s) for s in sure), (a, b)
            assert r.pos == len(text.rstrip())


@pytest.mark.parametrize("text, out", [
    ('{"a": 1 x}', '{"a": 1'), ('{"a": 01}', '{"a": '), ('{"a": NaN}', '{"a": '), ('{"a" 1}', '{"a"'),
    ('{"a": 1, "a": 2}', '{"a": 1, "a"'),  # a key twice: not JSON here (Python would keep the last value)
    ('{"a": "\\x"}', '{"a": "'), ('{"a": 1e400}', '{"a": '), ('{"a": "\x01"}', '{"a": "'), ('{"a": 1', '{"a": 1'),
    ('{"a": tru}', '{"a": '), ('{"a": "\\ud83d\\u12G4"}', '{"a": "'), ('{"a": ' + "1" * 4301 + "}", '{"a": '),
    ('{"a": \u0663}', '{"a": '), ('{"a": 1, "b": \u00b2}', '{"a": 1, "b": '),  # other scripts' digits: not JSON
])
def test_json_reader_stops_where_the_text_stops_being_json(text, out):
    r = JsonReader()
    with pytest.raises(NotJson):
        r.read(text, final=True)
    assert r.out == out


@pytest.mark.parametrize("text, out", [
    ('{"a": "\\ud800"}', '{"a": "\\ud800"}'),
    ('{"a": "x\\uDC00y", "\\ud83d": "\\ud83d\\ude00"}', '{"a": "x\\udc00y", "\\ud83d": "\U0001f600"}'),
    ('{"a": "\ud800"}', '{"a": "\\ud800"}'),  # the character itself (a str from JSON text read before)
])
def test_a_lone_surrogate_stays_an_escape(text, out):
    """A lone surrogate (which `ensure_ascii=False` would write as it is) is written as its escape: the canonical
    text stays encodable in UTF-8 (a response carries it) and reads back to the same value."""
    for cut in range(len(text) + 1):
        r = JsonReader()
        r.read(text[:cut])
        r.read(text, final=True)
        assert r.out == out
    out.encode()
    assert json.loads(out) == json.loads(text)
