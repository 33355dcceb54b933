"""Bad training inputs are named, not swallowed: unknown message roles and contentless messages fail
at FILE:LINE, unknown keys of a prompts file get one warning, prompts past the prompt-length limit
get one warning counting them, and init-drafter warns about a mask id that is an ordinary token."""

import json
import re

import pytest
from click.testing import CliRunner

from dflash_trt.errors import ConfigError
from dflash_trt.training.prompts import load_prompts_jsonl
from tests.training.conftest import MASK, word_tokenizer


def _write(tmp_path, *objs):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return f


@pytest.mark.parametrize("message,err", [
    ({"role": "robot", "content": "x"},
     "message 2 has role 'robot'; the roles are system, user, assistant, tool; give each message one of them"),
    ({"role": "developer", "content": "x"},
     'message 2 has role \'developer\'; the roles are system, user, assistant, tool; give each message one of them '
     '(OpenAI\'s "developer" is "system" here)'),
    ({"role": "User", "content": "x"},
     "message 2 has role 'User'; the roles are system, user, assistant, tool; give each message one of them"),
    ({"content": "x"},
     'message 2 has no string "role"; the roles are system, user, assistant, tool; give each message one of them'),
    ({"role": "assistant"}, 'message 2 (assistant) has no "content"; give its text as a string (or as a list of '
     '{"type": "text", "text": "<text>"} parts)'),
    ({"role": "assistant", "content": None}, 'message 2 (assistant) has null as its "content"; give its text as a '
     'string (or as a list of {"type": "text", "text": "<text>"} parts)'),
    ({"role": "user", "content": []}, 'message 2 (user) has [] as its "content"; give its text as a string (or as a '
     'list of {"type": "text", "text": "<text>"} parts)'),
    ({"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "u"}}]},
     'message 2 (user): content part 2 has type "image_url"; only {"type": "text", "text": "<text>"} parts are read '
     "(the target takes text): remove the other parts"),
    ({"role": "user", "content": [{"type": "text"}]}, 'message 2 (user): content part 1 is a text part without a '
     'string "text"; give it as {"type": "text", "text": "<text>"}'),
    ({"role": "user", "content": [{"text": "x"}]}, 'message 2 (user): content part 1 has no "type"; only '
     '{"type": "text", "text": "<text>"} parts are read (the target takes text): remove the other parts'),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                            "function": {"name": "f", "arguments": "{}"}}]},
     'message 2 (assistant) is a tool call ("content" null, with "tool_calls"); prompts are rendered by the chat '
     "template as text only: remove the tool-call turns (and their tool results) from the conversation, or "
     "remove the line"),
    ("hello", 'message 2 is "hello", not an object; give each message as {"role": ..., "content": "<text>"}'),
])
def test_a_bad_message_fails_at_its_file_and_line(tmp_path, message, err):
    f = _write(tmp_path, {"prompt": "fine"}, {"messages": [{"role": "system", "content": "s"}, message]})
    with pytest.raises(ConfigError) as exc:
        load_prompts_jsonl(f)
    assert str(exc.value) == f"{f}:2: {err}"


@pytest.mark.parametrize("messages,roles", [
    ([{"role": "assistant", "content": "I am here."}], "assistant"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": " \n"}], "system, user (empty)"),
    ([{"role": "user", "content": ""}, {"role": "assistant", "content": "ok"}], "user (empty), assistant"),
])
def test_a_conversation_without_user_text_fails_at_its_line(tmp_path, messages, roles):
    """A conversation needs a user message with text: assistant-only or blank ones would send the
    target an empty question (generate would answer nothing in particular; training would learn noise)."""
    f = _write(tmp_path, {"prompt": "fine"}, {"messages": messages})
    with pytest.raises(ConfigError) as exc:
        load_prompts_jsonl(f)
    assert str(exc.value) == (f"{f}:2: the conversation has no user message with text ({roles}); a prompt needs "
                              'at least one {"role": "user", "content": "<text>"} message')


def test_openai_text_parts_are_joined(tmp_path, capsys):
    """OpenAI's content-part form of a text message ([{"type": "text", "text": ...}, ...]) loads as the
    parts' texts joined with newlines (it was refused as "not a string")."""
    parts = [{"type": "text", "text": "Write a haiku."}, {"type": "text", "text": "About rain."}]
    f = _write(tmp_path, {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                       {"role": "user", "content": parts}]})
    assert load_prompts_jsonl(f) == [[{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Write a haiku.\nAbout rain."}]]
    assert capsys.readouterr().err == ""


def test_every_allowed_role_loads_without_warnings(tmp_path, capsys):
    msgs = [{"role": r, "content": r} for r in ("system", "user", "assistant", "tool")]
    assert load_prompts_jsonl(_write(tmp_path, {"messages": msgs})) == [msgs]
    assert capsys.readouterr().err == ""


def test_unknown_keys_get_one_warning_naming_each_first_line(tmp_path, capsys):
    """OpenAI-style records load (extra keys never fail); one stderr line for the whole file names
    each unknown key with the first line holding it, in order of appearance, a message's own extra
    keys (e.g. "name") as messages[].KEY; they are dropped from the loaded messages."""
    f = _write(tmp_path, {"prompt": "a"}, {"prompt": "b", "id": "r1"},
               {"messages": [{"role": "user", "content": "c", "name": "x"}], "id": "r2", "source": "web"},
               {"prompt": "d", "source": "web"})
    assert load_prompts_jsonl(f) == ["a", "b", [{"role": "user", "content": "c"}], "d"]
    assert capsys.readouterr().err == (
        f'warning: {f}: ignoring unknown keys "id" (first on line 2), "source" (first on line 3), "messages[].name" '
        f'(first on line 3); only "prompt" or "messages" (each message\'s "role" and "content") is read from a line '
        "(extra fields such as OpenAI's \"id\" may stay; remove them to silence this)\n")
    load_prompts_jsonl(f)  # bench reads a file twice (check, then encode): the second read is quiet
    assert capsys.readouterr().err == ""
    f.write_text(f.read_text() + json.dumps({"prompt": "e", "tag": 1}) + "\n")  # new text: warned afresh
    load_prompts_jsonl(f)
    assert '"id" (first on line 2), "source" (first on line 3), "messages[].name" (first on line 3), "tag" (first on ' \
        'line 5)' in capsys.readouterr().err


def test_request_keys_are_not_named_twice(tmp_path, capsys):
    """With warn_keys (generate, bench), those keys get their own line and the unknown-key line names
    only the rest; bench's second read without warn_keys adds nothing."""
    from dflash_trt.training.prompts import REQUEST_KEYS

    f = _write(tmp_path, {"prompt": "a", "temperature": 0.5, "id": 1})
    load_prompts_jsonl(f, REQUEST_KEYS)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "per-line temperature ignored (first on line 1)" in lines[0]
    assert 'ignoring unknown keys "id" (first on line 1);' in lines[1] and "temperature" not in lines[1]
    load_prompts_jsonl(f)
    assert capsys.readouterr().err == ""


class _Tok:
    """A tokenizer with no chat template: each prompt character is one token."""
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}


def test_encode_all_warns_once_about_cut_prompts(tmp_path, capsys):
    """Prompts past the limit keep their last tokens (the return value is unchanged), and with warn one
    stderr line counts them, names the first and its length; without warn (a one-prompt check) and
    with nothing cut, silence."""
    from dflash_trt.training.pipeline import encode_all

    prompts = ["abc", "abcdefgh", "xy", "0123456789", "abcd"]
    want = [[ord(c) for c in p[-4:]] for p in prompts]
    assert encode_all(_Tok(), prompts, tmp_path, 4) == want
    assert capsys.readouterr().err == ""
    assert encode_all(_Tok(), prompts, tmp_path, 4, warn=True) == want
    assert capsys.readouterr().err == (
        "warning: 2 of 5 prompts are longer than 4 tokens (the first is prompt 2, 8 tokens); each keeps its last 4 "
        "tokens (the end holds the generation prompt); shorten them to keep their beginning\n")
    encode_all(_Tok(), ["abcdef"], tmp_path, 4, warn=True)
    assert capsys.readouterr().err.startswith("warning: 1 of 1 prompt is longer than 4 tokens (the first is prompt 1, 6")
    assert encode_all(_Tok(), prompts, tmp_path, 10, warn=True) == [[ord(c) for c in p] for p in prompts]
    assert capsys.readouterr().err == ""


def test_build_data_warns_about_cut_prompts_and_keeps_its_cache_settings(tmp_path, monkeypatch, capsys):
    """build_data passes warn=True, and its data-cache settings still record max_prompt_len (no model:
    the generation step is replaced)."""
    from dflash_trt.training import pipeline

    seen = {}

    def fake_generate(engine, ids, out, layer_ids, max_new_tokens, batch_size, settings, progress, max_samples):
        seen.update(ids=ids, settings=settings)
        return "stats"

    monkeypatch.setattr(pipeline, "generate_dataset", fake_generate)
    monkeypatch.setattr("dflash_trt.runtime.engine.Engine", lambda *a, **k: None)
    monkeypatch.setattr("dflash_trt.models.loading.weights_fingerprint", lambda path: "sha")
    assert pipeline.build_data(tmp_path / "t", None, _Tok(), (), ["abcdef", "ab"], tmp_path, (), max_prompt_len=3) == "stats"
    assert seen["ids"] == [[ord(c) for c in "def"], [ord(c) for c in "ab"]]
    assert seen["settings"]["max_prompt_len"] == 3 and set(seen["settings"]) == {"target", "target_weights",
                                                                                 "prompts_sha256", "max_prompt_len", "dtype"}
    assert capsys.readouterr().err.startswith("warning: 1 of 2 prompts is longer than 3 tokens")


def test_mask_token_warning_rules():
    """Ids past the tokenizer and special tokens that text never holds pass; an ordinary token, BOS / EOS /
    PAD / UNK and chat-template markers get a warning naming the id, its string and a token to use (the
    default's when it passes, else a spare special id). The default is the last row unless that is text."""
    from tokenizers import AddedToken

    from dflash_trt.models.mask_token import default_mask_token, mask_token_warning

    tok = word_tokenizer()  # special: w0 (unk), w2 (eos); 64 tokens; no spare special token
    assert mask_token_warning(tok, 64, 63) is None  # an unused embedding row never comes from text
    for streamed in (0, 2):  # UNK, EOS
        assert f"('w{streamed}') is a special token that occurs in the target's text" in mask_token_warning(tok, streamed, 63)
    assert mask_token_warning(tok, MASK, 63) == (
        "warning: mask token id 3 ('w3') is an ordinary token of the target's tokenizer; the mask should be a token "
        "that never appears in text: add a special token to the target's tokenizer and pass its id as --mask-token-id")
    assert mask_token_warning(tok, MASK, 70).endswith(": pass --mask-token-id 70 (an unused embedding row) or another "
                                                      "special token that text never holds")
    assert default_mask_token(tok, 64) == (63, "the last vocab row")  # nothing better: the warning then says so
    assert default_mask_token(tok, 80) == (79, "the last vocab row")  # a padded vocabulary: an unused row
    assert default_mask_token(None, 64) == (63, "the last vocab row")
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("<mask>", special=True),
                                                          AddedToken("<turn>", special=True)]})  # ids 64, 65
    tok.chat_template = "{% for m in messages %}<turn>{{ m['content'] }}{% endfor %}"
    assert mask_token_warning(tok, 64, 63) is None
    assert "('<turn>') is a special token that occurs" in mask_token_warning(tok, 65, 63)  # a chat-template marker
    assert mask_token_warning(tok, MASK, 63).endswith(": pass --mask-token-id 64 ('<mask>') or another special token "
                                                      "that text never holds")
    assert default_mask_token(tok, 66) == (64, "the tokenizer's spare special token '<mask>' (the last vocab row is text)")


def test_init_drafter_warns_about_an_ordinary_mask_token(tmp_path, target_with_tokenizer, tiny_target_dir):
    """The CLI loads the target's tokenizer and warns (stderr) for --mask-token-id 3 ('w3') and for UNK
    'w0'; the drafter is written either way. A target without tokenizer files is not checked."""
    from dflash_trt.cli import cli

    def init(folder, mask, out):
        return CliRunner().invoke(cli, ["init-drafter", "--target", str(folder), "--out", str(tmp_path / out),
                                        "--mask-token-id", str(mask), "--target-layer-ids", "0,2"])

    res = init(target_with_tokenizer, MASK, "a")
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert re.search(r"warning: mask token id 3 \('w3'\) is an ordinary token", res.stderr), res.stderr
    res = init(target_with_tokenizer, 0, "b")  # UNK: special, but text holds it
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "warning: mask token id 0 ('w0') is a special token that occurs in the target's text" in res.stderr
    res = init(tiny_target_dir, MASK, "c")
    assert res.exit_code == 0 and "mask token id" not in res.stderr, res.output + repr(res.exception)


def test_a_bom_past_the_first_line_and_deep_nesting_are_one_line_errors(tmp_path):
    """A byte-order mark on line 2 (two files joined) got json's 'decode using utf-8-sig' hint; a line nested
    100,000 deep raised RecursionError out of the loader."""
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n\xef\xbb\xbf{"prompt": "b"}\n')  # line 1's mark is allowed
    with pytest.raises(ConfigError) as exc:
        load_prompts_jsonl(f)
    assert str(exc.value) == (f"{f}:2: starts with a byte-order mark (U+FEFF), e.g. from files joined together; remove "
                              "it (only the file's first line may have one)")
    f.write_text('{"prompt": "a"}\n{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(ConfigError) as exc:
        load_prompts_jsonl(f)
    assert str(exc.value) == (f'{f}:2: JSON nested too deeply to read; each line must be one JSON object of '
                              '{"prompt": ...} or {"messages": [...]}')
