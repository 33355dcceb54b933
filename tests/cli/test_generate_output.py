"""What `dflash-trt generate` prints: a header per answer for several prompts, no U+FFFD for a character that
--max-tokens cut, the exit codes of --block-size / --max-draft-len errors, and the answers kept (each written as it
finishes, in prompt order) with one line saying how many when Ctrl-C or SIGTERM stops it. Real models: SmolLM2 (the
default target and drafter)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_main


@pytest.fixture(scope="module")
def decode(smollm2_path):
    """SmolLM2's tokenizer as `Pipeline.decode` uses it: (encode, decode)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    return (lambda text: tok(text)["input_ids"],
            lambda ids: tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))


def test_final_text_drops_a_character_cut_by_max_tokens(decode):
    """SmolLM2 splits "😀" (4 bytes) over 2-3 tokens and "日" / "語" over 2: cut after the first of them, the
    decode ends in one U+FFFD, which `final_text` drops for finish_reason "length" only; a U+FFFD inside
    the text (a literal one is a token of its own) is kept, and the streamed text adds up to the final one."""
    from dflash_trt.text import final_text, text_to_stream

    enc, dec = decode
    hi = enc("Hi 😀")
    assert hi == [26843, 40303, 218]  # "Hi", " " + the emoji's first 3 bytes, its last byte
    assert dec(hi[:2]) == "Hi \ufffd" and dec(hi) == "Hi 😀"
    assert final_text(dec(hi[:2]), "length") == "Hi " and final_text(dec(hi), "length") == "Hi 😀"
    assert final_text(dec(hi[:2]), "stop") == "Hi \ufffd"  # stopped on its own: the text's own bytes
    ja = enc("日本語")
    assert len(ja) == 6 and [dec(ja[:i]) for i in (1, 4, 5)] == ["\ufffd", "日本\ufffd", "日本\ufffd"]
    assert [final_text(dec(ja[:i]), "length") for i in (1, 2, 4, 5, 6)] == ["", "日", "日本", "日本", "日本語"]
    genuine = enc("a\ufffdb")
    assert dec(genuine) == "a\ufffdb" and final_text(dec(genuine), "length") == "a\ufffdb"
    assert final_text(dec(genuine + hi[:2]), "length") == "a\ufffdbHi "  # only the cut character goes
    for ids in (hi[:2], ja[:5]):
        shown = ""
        for i in range(1, len(ids) + 1):
            shown += text_to_stream(dec(ids[:i]), shown)
        final = final_text(dec(ids), "length")
        assert final.startswith(shown) and "\ufffd" not in final  # the CLI prints final[len(shown):] at the end


@pytest.mark.slow
def test_max_tokens_cut_inside_a_character_prints_no_replacement_char(monkeypatch, capsys, decode):
    """Greedy --mode ar on a Japanese prompt, cut by --max-tokens where the tokens so far decode to a trailing
    U+FFFD: --json's text and the streamed stdout end before the cut character, the token ids are all there."""
    _, dec = decode
    args = ("generate", "--prompt", "日本語で挨拶: ", "--mode", "ar")
    code, out, err = run_main(monkeypatch, capsys, *args, "--max-tokens", "24", "--json")
    assert code == 0, err
    ids = json.loads(out.strip().splitlines()[-1])["token_ids"]
    cut = next(i for i in range(1, len(ids)) if dec(ids[:i]).endswith("\ufffd"))
    code, out, err = run_main(monkeypatch, capsys, *args, "--max-tokens", str(cut), "--json")
    assert code == 0, err
    obj = json.loads(out.strip().splitlines()[-1])
    assert obj["token_ids"] == ids[:cut] and obj["finish_reason"] == "length"
    assert obj["text"] == dec(ids[:cut])[:-1] and not obj["text"].endswith("\ufffd")
    for mode in ("ar", "dflash"):
        code, out, err = run_main(monkeypatch, capsys, *args[:-1], mode, "--max-tokens", str(cut))
        assert code == 0, err
        assert out == obj["text"] + "\n", (mode, out)


def test_several_prompts_print_a_header_before_each_answer(monkeypatch, capsys, tmp_path):
    """Two prompts, plain text: `=== prompt i/2 ===` before each answer (the --json texts, once each, in
    order), the stats lines on stderr as before; one prompt prints its answer alone."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "What is the capital of France?"}]}\n'
                       '{"messages": [{"role": "user", "content": "Name a colour."}]}\n')
    args = ("generate", "--prompts-file", str(prompts), "--max-tokens", "6")
    code, out, err = run_main(monkeypatch, capsys, *args, "--json")
    assert code == 0, err
    texts = [json.loads(line)["text"] for line in out.strip().splitlines()]
    assert len(texts) == 2 and texts[0] != texts[1] and all(texts), texts
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert code == 0, err
    assert out == f"=== prompt 1/2 ===\n{texts[0]}\n=== prompt 2/2 ===\n{texts[1]}\n"
    assert out.count(texts[0]) == 1 and out.count(texts[1]) == 1
    stats = err.strip().splitlines()
    assert [line.startswith("[dflash] 6 tokens, finish=length, tau=") for line in stats[-2:]] == [True, True]

    code, out, err = run_main(monkeypatch, capsys, "generate", "--chat", "What is the capital of France?",
                              "--max-tokens", "6")
    assert code == 0 and out == texts[0] + "\n"  # a single prompt: the answer alone, streamed


def test_draft_length_errors_exit_2_on_their_own_and_against_the_drafter(monkeypatch, capsys):
    """The convention: a value invalid on the command line alone (--block-size out of [2, 64], --max-draft-len
    out of [1, 63] or above --block-size - 1) is a usage error, exit 2, before anything loads; so is one above
    the drafter's own block (--max-draft-len 16 with its block of 16: read from its config.json; it was the
    loader's error, exit 1, while every other flag error exits 2). Every message names the flag and the
    allowed values, with no traceback."""
    base = ("generate", "--prompt", "hi", "--max-tokens", "2")
    for flag, value, allowed in (("--block-size", "1", "2<=x<=64"), ("--block-size", "65", "2<=x<=64"),
                                 ("--max-draft-len", "0", "1<=x<=63"), ("--max-draft-len", "64", "1<=x<=63")):
        code, _, err = run_main(monkeypatch, capsys, *base, flag, value)
        assert code == 2, (flag, value, err)
        assert f"error: Invalid value for '{flag}': {value} is not in the range {allowed}" in err
        assert "Traceback" not in err
    code, _, err = run_main(monkeypatch, capsys, *base, "--block-size", "4", "--max-draft-len", "8")
    assert code == 2 and ("error: Invalid value for '--max-draft-len': 8 is more than the 3 drafts a block of "
                          "--block-size 4 holds; use --max-draft-len 3 or less, or raise --block-size") in err
    code, out, err = run_main(monkeypatch, capsys, *base, "--max-draft-len", "16")
    assert code == 2 and out == "" and "Traceback" not in err
    assert err == ("error: Invalid value for '--max-draft-len': 16 is more than the 15 drafts the drafter's block of "
                   "16 holds; use --max-draft-len 15 or less, or use a drafter of a larger block (see 'dflash-trt "
                   "generate --help')\n"), err
    for extra in (("--prompt-lookup", "16"), ("--mode", "ar", "--max-draft-len", "16")):  # as the flags allow
        code, out, err = run_main(monkeypatch, capsys, *base, *extra, "--max-tokens", "1")
        assert (code == 2 and "'--prompt-lookup': 16 is more than the 15 drafts" in err) if extra[0] == "--prompt-lookup" \
            else code == 0, err


def test_ctrl_c_in_generate_is_one_line_and_exit_130(monkeypatch, capsys):
    """Ctrl-C while generate decodes: one stderr line, exit 130 (128 + SIGINT), no traceback, nothing on stdout."""
    import dflash_trt.api

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dflash_trt.api.Pipeline, "generate", interrupted)
    code, out, err = run_main(monkeypatch, capsys, "generate", "--prompt", "Hi", "--max-tokens", "2", "--json")
    assert (code, out, err) == (130, "", "generate interrupted (Ctrl-C) before the answer was finished; nothing was "
                                         "written to stdout\n")


@pytest.mark.parametrize("stop, how, code", [("KeyboardInterrupt", "interrupted (Ctrl-C)", 130),
                                             ("Terminated", "terminated (SIGTERM)", 143)])
def test_ctrl_c_while_the_models_load_names_generate(monkeypatch, capsys, tmp_path, stop, how, code):
    """Ctrl-C / SIGTERM while generate loads the models: generate's own line (it was the bare "interrupted
    (Ctrl-C)" of any command), exit 130 / 143, nothing on stdout; with --prompts-file too."""
    import dflash_trt.cli.common
    from dflash_trt.interrupts import Terminated

    def loading(*args, **kwargs):
        raise {"KeyboardInterrupt": KeyboardInterrupt, "Terminated": Terminated}[stop]

    monkeypatch.setattr(dflash_trt.cli.common, "load_models", loading)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hi"}\n')
    for source in (("--prompt", "Hi"), ("--prompts-file", str(prompts))):
        got = run_main(monkeypatch, capsys, "generate", *source, "--max-tokens", "2")
        assert got == (code, "", f"generate {how} while loading the models; nothing was written to stdout\n"), got


def _interrupted_after(monkeypatch, answers: int = 0, tokens: int | None = None, stop=KeyboardInterrupt):
    """Pipeline.generate stopped by `stop` (Ctrl-C's KeyboardInterrupt, SIGTERM's Terminated) as a signal would:
    once `answers` answers were handed out (written by generate), or after `tokens` tokens of the first prompt."""
    import dflash_trt.api

    real = dflash_trt.api.Pipeline.generate
    real, seen = getattr(real, "unpatched", real), {"answers": 0, "tokens": 0}  # a second call replaces the first

    def generate(self, prompts, params=None, mode="dflash", on_tokens=None, on_finished=None):
        def finished(i, res):
            on_finished(i, res)
            seen["answers"] += 1
            if seen["answers"] == answers:
                raise stop

        def streamed(i, toks, *rest):
            if on_tokens is not None:
                on_tokens(i, toks, *rest)
            seen["tokens"] += len(toks)
            if seen["tokens"] >= tokens:
                raise stop

        return real(self, prompts, params, mode, streamed if tokens else on_tokens, finished)

    generate.unpatched = real
    monkeypatch.setattr(dflash_trt.api.Pipeline, "generate", generate)


#: a short first prompt (12 tokens, then its end of turn), a long one (it counts on to --max-tokens), a third
_FIRST = '{"messages": [{"role": "user", "content": "What is 2+2?"}]}\n'
_PROMPTS = _FIRST + '\n{"prompt": "1, 2, 3, 4, 5,"}\n{"messages": [{"role": "user", "content": "Name a colour."}]}\n'
_GENERATE = ["-c", "from dflash_trt.cli import main; main()", "generate", "--max-tokens", "600", "--json",
             "--threads", "1"]


@pytest.fixture(scope="module")
def first_answer_alone(tmp_path_factory):
    """The --json answer of an uninterrupted `generate` run on the first prompt of `_PROMPTS` alone."""
    import os
    import subprocess
    import sys

    alone = tmp_path_factory.mktemp("first") / "first.jsonl"
    alone.write_text(_FIRST)
    return json.loads(subprocess.run([sys.executable, *_GENERATE, "--prompts-file", str(alone)], capture_output=True,
                                     text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                                     timeout=300, check=True).stdout)


@pytest.mark.parametrize("stop, how, code", [("SIGINT", "interrupted (Ctrl-C)", 130),
                                             ("SIGTERM", "terminated (SIGTERM)", 143)])
def test_answers_finished_before_ctrl_c_or_sigterm_are_kept_in_prompt_order(tmp_path, first_answer_alone, stop, how,
                                                                              code):
    """A real `generate --prompts-file --json` process: the short first prompt's answer is on stdout, whole and
    flushed, while the long second one still decodes (and the third, finished or not, waits for it: prompt
    order). Signalled then, it exits 130 / 143 keeping that line, equal to the first prompt's answer alone, and
    stderr's last line says 1 of 3 answered and the `tail -n +3` that continues (line 2 is blank)."""
    import os
    import shlex
    import signal
    import subprocess
    import sys

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(_PROMPTS)
    want = first_answer_alone
    proc = subprocess.Popen([sys.executable, *_GENERATE, "--prompts-file", str(prompts)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                            # SIGINT as in a terminal (a shell starts background jobs with it ignored)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        proc.send_signal(getattr(signal, stop))
        proc.wait(timeout=120)
    finally:
        proc.kill()
    rest, err = proc.stdout.read(), proc.stderr.read()  # not communicate(): it skips what readline buffered
    assert proc.returncode == code and rest == "" and "Traceback" not in err, (proc.returncode, rest, err)
    got = json.loads(line)
    assert line.endswith("}\n") and got["finish_reason"] == "stop", line
    assert got["text"] == "The answer to this classic math problem is 4."
    for key in ("text", "token_ids", "finish_reason", "stop_reason"):
        assert got[key] == want[key], key
    assert [got["metrics"][k] for k in ("prompt_tokens", "completion_tokens")] == [
        want["metrics"][k] for k in ("prompt_tokens", "completion_tokens")]
    assert err.splitlines()[-1] == (f"generate {how}: 1 of 3 prompts answered and written to stdout; the rest start "
                                    f"at line 3 of {prompts}: continue with --prompts-file <(tail -n +3 "
                                    f"{shlex.quote(str(prompts))})")


def test_plain_text_answers_written_before_ctrl_c_stay(monkeypatch, capsys, tmp_path):
    """The plain-text format as --json: stopped once the first answer is written, stdout holds its header and
    text (the --json run's) only, then one stderr line (the first's statistics line before it); stopped before
    any answer, nothing; stopped after the last, all of them."""
    from dflash_trt.interrupts import Terminated

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "The capital of France is"}\n{"prompt": "def add(a, b):"}\n')
    args = ("generate", "--prompts-file", str(prompts), "--max-tokens", "6", "--threads", "1")
    code, out, err = run_main(monkeypatch, capsys, *args, "--json")
    assert code == 0, err
    texts = [json.loads(line)["text"] for line in out.splitlines()]

    _interrupted_after(monkeypatch, answers=1)
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert (code, out) == (130, f"=== prompt 1/2 ===\n{texts[0]}\n"), err
    lines = err.splitlines()
    assert lines[-2].startswith("[dflash] 6 tokens, finish=length") and lines[-1] == (
        f"generate interrupted (Ctrl-C): 1 of 2 prompts answered and written to stdout; the rest start at line 2 of "
        f"{prompts}: continue with --prompts-file <(tail -n +2 {prompts})")

    _interrupted_after(monkeypatch, answers=2, stop=Terminated)
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert (code, out) == (143, f"=== prompt 1/2 ===\n{texts[0]}\n=== prompt 2/2 ===\n{texts[1]}\n"), err
    assert err.splitlines()[-1] == "generate terminated (SIGTERM): 2 of 2 prompts answered and written to stdout"

    _interrupted_after(monkeypatch, tokens=1)
    code, out, err = run_main(monkeypatch, capsys, *args, "--json")
    assert (code, out) == (130, ""), err
    assert err.splitlines()[-1] == ("generate interrupted (Ctrl-C): 0 of 2 prompts answered, nothing was written to "
                                    "stdout; rerun the same command")


def test_ctrl_c_mid_stream_of_a_single_prompt_says_what_stdout_holds(monkeypatch, capsys):
    """--prompt / --chat stream their answer: Ctrl-C after its first tokens leaves them on stdout, their line
    ended, and stderr's line says the answer is cut there; once the answer is written, it says so."""
    args = ("generate", "--prompt", "The capital of France is", "--mode", "ar", "--max-tokens", "8")
    code, whole, err = run_main(monkeypatch, capsys, *args)
    assert code == 0, err
    _interrupted_after(monkeypatch, tokens=1)
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert (code, out) == (130, " Paris\n"), err
    assert err == "generate interrupted (Ctrl-C) mid-answer; stdout holds the answer so far\n"
    _interrupted_after(monkeypatch, answers=1)
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert (code, out) == (130, whole), err
    assert err.splitlines()[-1] == "generate interrupted (Ctrl-C) after the answer was written to stdout"


def test_the_stopped_line_for_a_prompts_file_that_is_a_pipe_names_the_line_only():
    """A pipe (`--prompts-file <(...)`) cannot be read again: the line of the first prompt left, no `tail`."""
    from dflash_trt.cli.answers import stopped_line

    assert stopped_line("interrupted (Ctrl-C)", 2, 5, prompts_file="/dev/fd/63", lines=[1, 2, 4, 5, 6]) == (
        "generate interrupted (Ctrl-C): 2 of 5 prompts answered and written to stdout; the rest start at line 4 of "
        "/dev/fd/63")


def test_an_error_mid_stream_starts_on_its_own_line(monkeypatch, capsys):
    """A generation that fails after streaming part of its answer (e.g. the drafter's non-finite draft
    probabilities) ends the partial answer's line on stdout; the error is stderr's own line, exit 1."""
    import dflash_trt.api
    from dflash_trt.errors import DFlashError

    real = dflash_trt.api.Pipeline.generate

    def fails_after_a_token(self, prompts, params=None, mode="dflash", on_tokens=None, on_finished=None):
        def tokens(i, toks, *rest):  # " Paris": the first token streamed, then the failure
            on_tokens(i, toks, *rest)
            raise DFlashError("the drafter produced non-finite draft probabilities")

        return real(self, prompts, params, mode, tokens, on_finished)

    monkeypatch.setattr(dflash_trt.api.Pipeline, "generate", fails_after_a_token)
    code, out, err = run_main(monkeypatch, capsys, "generate", "--prompt", "The capital of France is", "--mode", "ar",
                              "--max-tokens", "8")
    assert code == 1 and out == " Paris\n", (code, out, err)  # it had been " Paris" with stderr's line after it
    assert err.startswith("error: the drafter produced non-finite"), (out, err)


def test_json_logprobs_are_the_targets_and_need_json(monkeypatch, capsys, smollm2_pipeline):
    """`--logprobs N --json`: one entry per token id, the runtime's own values (greedy: each token is its
    distribution's most likely, first among its alternatives); without --json a usage error (exit 2)."""
    from dflash_trt.runtime.sampling import SamplingParams

    code, out, err = run_main(monkeypatch, capsys, "generate", "--prompt", "def add(a, b):", "--max-tokens", "8",
                              "--dtype", "float32", "--json", "--logprobs", "2", "--threads", "1")
    assert code == 0, err
    obj = json.loads(out)
    lps = obj["logprobs"]
    assert [e["token_id"] for e in lps] == obj["token_ids"] and len(lps) == 8
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token_id"] == e["token_id"] for e in lps)
    assert "".join(e["token"] for e in lps) == obj["text"]
    assert b"".join(bytes(e["bytes"]) for e in lps).decode() == obj["text"]  # each token's exact UTF-8 bytes
    assert all(bytes(a["bytes"]).decode() == a["token"] for e in lps for a in e["top_logprobs"])
    [ref] = smollm2_pipeline.generate([smollm2_pipeline.encode("def add(a, b):")],
                                      SamplingParams(max_tokens=8, logprobs=0), mode="ar")
    assert [e["logprob"] for e in lps] == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-3)
    code, out, err = run_main(monkeypatch, capsys, "generate", "--prompt", "x", "--logprobs", "2")
    assert code == 2 and "--logprobs prints the log-probabilities in --json's objects: add --json" in err
