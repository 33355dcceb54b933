"""Prompt sources: the default corpus never overlaps the evaluation sets; JSONL errors are clear."""

import json
import re

import pytest

from dflash_trt.errors import ConfigError, DFlashError
from dflash_trt.datasets import humaneval_prompts, mt_bench_first_turns
from dflash_trt.datasets import mt_bench_questions
from dflash_trt.training.prompts import chat_corpus, code_corpus, default_corpus, load_prompts_jsonl


def _ngrams(text, n=13):
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_default_corpus_does_not_overlap_eval_sets():
    corpus = [m[0]["content"] for m in default_corpus()]
    assert len(corpus) == len(chat_corpus()) + len(code_corpus()) > 3000
    evals = list(humaneval_prompts()) + [t for q in mt_bench_questions() for t in q["turns"]]
    assert len(evals) == 164 + 160
    norm = lambda s: " ".join(s.split()).lower()  # noqa: E731
    eval_texts = {norm(e) for e in evals}
    assert not eval_texts & {norm(c) for c in corpus}
    eval_grams = set().union(*(_ngrams(e) for e in evals))
    shared = [c for c in corpus if _ngrams(c) & eval_grams]
    assert shared == []
    # no HumanEval function (signature line) appears in a code prompt
    he_sigs = {norm(line) for e in humaneval_prompts() for line in e.splitlines() if line.startswith("def ")}
    assert not [c for c in corpus if any(sig in norm(c) for sig in he_sigs)]
    assert mt_bench_first_turns()[0] not in corpus


def test_jsonl_prompts_and_messages(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hi"}) + "\n\n" + json.dumps({"messages": [{"role": "user", "content": "yo"}]}) + "\n")
    assert load_prompts_jsonl(f) == ["hi", [{"role": "user", "content": "yo"}]]
    f.write_bytes(b"\xef\xbb\xbf" + f.read_bytes())  # a UTF-8 byte-order mark, as Windows editors write
    assert load_prompts_jsonl(f) == ["hi", [{"role": "user", "content": "yo"}]]


@pytest.mark.parametrize("text,err,msg", [
    ("", DFlashError, "empty"),
    ("\n\n", DFlashError, "empty"),
    ('{"prompt": "ok"}\nnot json\n', ConfigError, ":2: not valid JSON"),
    ('{"text": "x"}\n', ConfigError, ":1: expected"),
    ('{"messages": [{"role": "user"}]}\n', ConfigError, ':1: message 1 (user) has no "content"; give its text'),
    ('{"prompt": ""}\n', ConfigError, ':1: the "prompt" is empty; give the text to answer, or remove the line'),
    ('{"prompt": "ok"}\n{"prompt": " \\n "}\n', ConfigError, ':2: the "prompt" is empty'),
    ('{"messages": []}\n', ConfigError, ':1: "messages" is an empty list; give at least one {"role": "user", '
     '"content": "<text>"} message, or remove the line'),
    ('{"prompt": 3}\n', ConfigError, ":1: expected"),
    ('{"prompt": "a"}\n{"prompt": "b", "messages": [{"role": "user", "content": "c"}]}\n', ConfigError,
     ':2: holds both "prompt" and "messages"; keep one of them'),
])
def test_bad_prompt_files(tmp_path, text, err, msg):
    f = tmp_path / "bad.jsonl"
    f.write_text(text)
    with pytest.raises(err, match=re.escape(msg)):
        load_prompts_jsonl(f)


def test_missing_prompts_file(tmp_path):
    with pytest.raises(DFlashError, match="no such prompts file; give an existing JSONL file"):
        load_prompts_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match="is a directory; give a JSONL file"):
        load_prompts_jsonl(tmp_path)


def test_request_keys_in_a_prompts_file_are_named_once(tmp_path, capsys):
    """Per-line sampling keys are not per-request settings here: with warn_keys, one warning names them
    and the first line holding one; the prompts load as usual; without warn_keys (training), they are
    unknown keys like "id" (one warning, each key's first line), which a second read does not repeat."""
    from dflash_trt.training.prompts import REQUEST_KEYS

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "id": 1}\n{"prompt": "b", "temperature": 1.0}\n'
                 '{"messages": [{"role": "user", "content": "c"}], "seed": 3, "temperature": 0}\n')
    assert load_prompts_jsonl(f) == ["a", "b", [{"role": "user", "content": "c"}]]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'unknown keys "id" (first on line 1), "temperature" (first on line 2), "seed" ' \
        "(first on line 3);" in err
    assert len(load_prompts_jsonl(f, REQUEST_KEYS)) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "per-line temperature, seed ignored (first on line 2)" in err and "id" not in err


def test_task_corpus_families_are_seeded_distinct_and_held_out():
    """Task prompts (training/tasks.py): each family gives N distinct prompts, the same for a seed
    and others for another seed; the corpus covers every family, and not one of its prompts had
    to be dropped for sharing a 13-word span or a whole text with HumanEval / MT-Bench."""
    from dflash_trt.training.tasks import FAMILIES, task_corpus, task_prompts

    assert set(FAMILIES) == {"math", "reasoning", "extraction", "roleplay", "writing", "coding", "explain"}
    with pytest.raises(ConfigError, match="unknown task family 'poetry'; the families are math, reasoning"):
        task_prompts("poetry", 3)
    for fam in FAMILIES:
        a = task_prompts(fam, 50)
        assert len(a) == len(set(a)) == 50 and a == task_prompts(fam, 50), fam
        assert a != task_prompts(fam, 50, seed=1), fam
    corpus = [m[0]["content"] for m in task_corpus(per_family=300)]
    assert len(corpus) == sum(len(task_prompts(f, 300)) for f in FAMILIES) > 1500  # nothing dropped
    assert len(set(corpus)) == len(corpus)
    evals = list(humaneval_prompts()) + [t for q in mt_bench_questions() for t in q["turns"]]
    eval_grams = set().union(*(_ngrams(e) for e in evals))
    assert [c for c in corpus if _ngrams(c) & eval_grams] == []
    norm = lambda s: " ".join(s.split()).lower()  # noqa: E731
    assert not {norm(e) for e in evals} & {norm(c) for c in corpus}


def test_unicode_line_separators_inside_strings_are_text(tmp_path):
    """json.dumps(..., ensure_ascii=False) writes U+2028 / U+2029 / U+0085 unescaped; they are text inside
    a JSON string, not line breaks (str.splitlines() split there: 'Unterminated string'). Line numbers
    of later lines stay right, and CRLF endings load."""
    from dflash_trt.cli.common import prompt_file_lines

    texts = ["one\u2028two", "three\u2029four", "five\u0085six"]
    f = tmp_path / "u.jsonl"
    f.write_text("".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\r\n" for t in texts)
                 + '\n{"prompt": 1}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"{f}:5: expected")):
        load_prompts_jsonl(f)
    f.write_text(f.read_text(encoding="utf-8").replace('\n{"prompt": 1}\n', ""), encoding="utf-8")
    assert load_prompts_jsonl(f) == texts and prompt_file_lines(f) == [1, 2, 3]


def test_a_pipe_is_read_once_and_seen_by_every_reader(tmp_path):
    """`--prompts-file <(...)` is a pipe: it can be read once, and a command reads its prompts file twice
    (the prompts, then the line numbers of messages). Both readers see its text; "-" says to use /dev/stdin."""
    import os
    import threading

    from dflash_trt.cli.common import prompt_file_lines

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n'))
    writer.start()
    assert load_prompts_jsonl(fifo) == ["a", "b"]
    writer.join(timeout=10)
    assert prompt_file_lines(fifo) == [1, 3] and load_prompts_jsonl(fifo) == ["a", "b"]  # no second writer: kept
    with pytest.raises(DFlashError, match=re.escape("-: no such prompts file; give an existing JSONL file (for "
                                                    "standard input, give /dev/stdin)")):
        load_prompts_jsonl("-")


def test_a_conversation_ending_with_an_assistant_turn_loses_it_for_training(tmp_path, capsys):
    """SFT-style lines (the answer included): train-drafter drops the trailing assistant turns, so the target
    writes its own answer after the generation prompt (it had followed the finished turn), and says so once."""
    import json

    from dflash_trt.training.pipeline import training_prompts

    say = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hello there"}]
    multi = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A?"},
             {"role": "assistant", "content": "a"}, {"role": "user", "content": "B?"}]
    f = tmp_path / "sft.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in ({"prompt": "plain"}, {"messages": multi}, {"messages": say},
                                                   {"messages": say + [{"role": "assistant", "content": "More"}]})))
    assert training_prompts(f) == ["plain", multi, say[:1], say[:1]]  # an answer inside a conversation stays
    assert capsys.readouterr().err == (f"note: 2 of 4 prompts in {f} end with an assistant turn (the first is "
                                       "prompt 3); it is dropped and the target writes its own answer there\n")
