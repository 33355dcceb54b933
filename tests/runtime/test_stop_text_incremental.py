"""`StopText` decodes incrementally: each step decodes a bounded tail of the output (not the whole output again),
and every value it gives (text, streamed deltas, the stop cut, token counts) is what decoding the whole output
each time gives, on the real SmolLM2 tokenizer (multi-byte characters split over byte-level pieces included) and
on tokenizers whose text of a token depends on the tokens before it."""

from __future__ import annotations

import random

import pytest

from dflash_trt.api import load_tokenizer
from dflash_trt.runtime.stop_text import StopText

TEXT = ("def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n"
        "        a, b = b, a + b\n    return a\n\n# 斐波那契数列 — la suite de Fibonacci 🌊🐚, Ελληνικά, emoji 👩‍💻 done.\n")


class Whole(StopText):
    """The reference: never commits, so every text is the whole output decoded again (what StopText did before)."""

    LAG = 10**9


@pytest.fixture(scope="module")
def decode(smollm2_path):
    tok = load_tokenizer(smollm2_path)

    def dec(ids):
        return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    dec.tokenizer = tok
    return dec


def run(cls, decode, ids, stops, chunks, token_aligned=False, min_tokens=0):
    """Feed `ids` in the given chunk sizes; every observable value after each add."""
    st = cls(decode, stops, token_aligned=token_aligned, min_tokens=min_tokens)
    seen, i = [], 0
    for size in chunks:
        if i >= len(ids):
            break
        reason = st.add(ids[i : i + size])
        i += size
        seen.append((reason, st.text, st.delta(), st.generated, st.sent_tokens(), st.matched))
        if reason == "stop":
            break
    seen.append(st.rest("stop" if st.stopped else "length"))
    return seen


def streams(decode, n_random=3):
    """Token streams: TEXT repeated (about 700 tokens, multi-byte characters), and random vocabulary ids (byte
    pieces that never form a character included), each with seeded random chunk sizes of 1-16."""
    rng = random.Random(0)
    vocab = decode.tokenizer.vocab_size
    text_ids = decode.tokenizer.encode(TEXT * 6)
    out = [text_ids] + [[rng.randrange(vocab) for _ in range(400)] for _ in range(n_random)]
    return [(ids, [rng.randint(1, 16) for _ in range(len(ids))]) for ids in out]


@pytest.mark.parametrize("stops", [(), ("done.\n# 斐",), ("🐚, Ελ", "zzzz")])
@pytest.mark.parametrize("token_aligned", [False, True])
def test_incremental_text_equals_decoding_the_whole_output(decode, stops, token_aligned):
    """Every add: the text equals decode(all ids), and the stop cut, deltas and counts equal the reference's."""
    for ids, chunks in streams(decode):
        st = StopText(decode, stops, token_aligned=token_aligned)
        i = 0
        for size in chunks:
            if i >= len(ids) or st.add(ids[i : i + size]) == "stop":
                break
            i += size
            assert st.text == decode(ids[:i])
        assert run(StopText, decode, ids, stops, chunks, token_aligned) == \
            run(Whole, decode, ids, stops, chunks, token_aligned)


def test_a_stop_string_far_into_a_long_output_is_found_and_cut_as_before(decode):
    """A stop string in the 6th copy of TEXT (past several commits) with min_tokens: the same cut as the reference,
    and it is the 6th copy's."""
    ids = decode.tokenizer.encode(TEXT * 6)
    stops = ("la suite",)
    chunks = [5] * len(ids)
    got = run(StopText, decode, ids, stops, chunks, min_tokens=len(ids) * 5 // 6)
    assert got == run(Whole, decode, ids, stops, chunks, min_tokens=len(ids) * 5 // 6)
    reason, text = got[-2][0], got[-2][1]
    assert reason == "stop" and text == (TEXT * 6)[: (TEXT * 6).rindex("la suite")]


def test_a_step_decodes_a_bounded_tail_not_the_whole_output(decode):
    """2,000 tokens fed 3 at a time: the ids decoded in all add calls together grow linearly with the output (at
    most 120 per call here), where decoding the whole output each time decodes about n^2 / 6 (~670,000)."""
    ids = (decode.tokenizer.encode(TEXT * 20))[:2000]
    counted = [0]

    def counting(x):
        counted[0] += len(x)
        return decode(x)

    for cls in (StopText, Whole):
        counted[0] = 0
        st = cls(counting, ("never there",))
        for i in range(0, len(ids), 3):
            st.add(ids[i : i + 3])
            st.delta()
        assert st.text == decode(ids)
        if cls is StopText:
            assert counted[0] <= 120 * (len(ids) // 3 + 1)
        else:
            assert counted[0] > 600_000


def sentencepiece_like(ids):
    """A tokenizer whose first piece loses its leading space (SentencePiece's "▁" at the start of a text)."""
    return "".join(f" w{i}" for i in ids)[1:]


def cleans_up(ids):
    """A tokenizer that rewrites earlier text: pieces end with a space, which a "." piece after them removes
    (clean_up_tokenization_spaces' " ." -> ".")."""
    return "".join("." if i % 7 == 0 else f"w{i} " for i in ids).replace(" .", ".")


@pytest.mark.parametrize("dec", [sentencepiece_like, cleans_up])
def test_tokenizers_whose_piece_text_depends_on_context_give_the_whole_decode(dec):
    """Where a piece's text depends on the pieces before it, the text is still decode(all ids) at every step (the
    window before the committed point, or the fallback to a whole decode where its text changed)."""
    rng = random.Random(1)
    ids = [rng.randrange(50) for _ in range(500)]
    st = StopText(dec, ("w3 w4",) if dec is sentencepiece_like else ("w3 w4 ",))
    i = 0
    while i < len(ids) and not st.stopped:
        size = rng.randint(1, 16)
        st.add(ids[i : i + size])
        i += size
        if not st.stopped:
            assert st.text == dec(ids[:i])
    chunks = [rng.randint(1, 16) for _ in range(500)]
    assert run(StopText, dec, ids, ("w3 w4",), chunks) == run(Whole, dec, ids, ("w3 w4",), chunks)
