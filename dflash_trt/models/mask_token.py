"""The drafter's mask token: the id that fills the unknown positions of a drafted block (DFlash paper
sec. 3, the drafter's input). It must never occur in the target's token streams, or a block would hold it as
both a mask and a word: an unused embedding row (an id past the tokenizer) or a special token that
text and chat templates never produce (not BOS / EOS / PAD / UNK, not a chat-template marker).
"""

from __future__ import annotations

_ROLE_TOKENS = ("bos", "eos", "pad", "unk")
_SAMPLE_CHAT = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
                {"role": "assistant", "content": "c"}]


def special_ids(tokenizer) -> set[int]:
    """The tokenizer's special ids: `all_special_ids` and added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def streamed_special_ids(tokenizer) -> set[int]:
    """Special ids that do occur in token streams: BOS / EOS / PAD / UNK, and the markers the chat
    template writes around a system + user + assistant conversation (a template that fails adds none)."""
    ids = {getattr(tokenizer, f"{k}_token_id", None) for k in _ROLE_TOKENS} - {None}
    if getattr(tokenizer, "chat_template", None):
        try:
            out = tokenizer.apply_chat_template(_SAMPLE_CHAT, tokenize=True)
            out = out["input_ids"] if hasattr(out, "keys") else out
            ids |= {int(i) for i in out} & special_ids(tokenizer)
        except Exception:  # noqa: BLE001  (a template that needs other roles or keys: nothing to add)
            pass
    return ids


def mask_problem(tokenizer, mask_id: int) -> str | None:
    """Why `mask_id` is a poor mask token for this tokenizer (a phrase), or None when it never occurs in text."""
    if mask_id >= len(tokenizer):
        return None  # an unused embedding row
    return _problem(mask_id, special_ids(tokenizer), streamed_special_ids(tokenizer))


def _problem(mask_id: int, special: set[int], streamed: set[int]) -> str | None:
    """`mask_problem` for an id inside the tokenizer, given its special and streamed special ids."""
    if mask_id not in special:
        return "is an ordinary token of the target's tokenizer"
    if mask_id in streamed:
        return "is a special token that occurs in the target's text (BOS / EOS / PAD / UNK or a chat-template marker)"
    return None


def token_name(tokenizer, i: int) -> str:
    """repr of id `i`'s token string, or "an unused embedding row" past the tokenizer."""
    return repr(tokenizer.convert_ids_to_tokens(i)) if i < len(tokenizer) else "an unused embedding row"


def spare_mask_id(tokenizer) -> int | None:
    """The highest special id that never occurs in text (`mask_problem` is None), or None."""
    special, streamed = special_ids(tokenizer), streamed_special_ids(tokenizer)  # once, not per id
    spare = sorted(i for i in special if i >= len(tokenizer) or _problem(i, special, streamed) is None)
    return spare[-1] if spare else None


def default_mask_token(tokenizer, vocab_size: int) -> tuple[int, str]:
    """The mask id to use when none is given, and why (a phrase): the last vocabulary row when it never
    occurs in text (e.g. Qwen3's padded rows), else the tokenizer's highest spare special token, else
    the last row anyway (`mask_token_warning` then says what to do). `tokenizer` None: the last row."""
    last = vocab_size - 1
    if tokenizer is None or mask_problem(tokenizer, last) is None:
        return last, "the last vocab row"
    spare = spare_mask_id(tokenizer)
    if spare is not None:
        return spare, f"the tokenizer's spare special token {token_name(tokenizer, spare)} (the last vocab row is text)"
    return last, "the last vocab row"


def mask_token_warning(tokenizer, mask_id: int, default_id: int) -> str | None:
    """The warning for a mask id that occurs in the target's text (`mask_problem`), else None. It names
    the id and its token and suggests `default_id` when that one is safe, else a spare special id."""
    problem = mask_problem(tokenizer, mask_id)
    if problem is None:
        return None
    pick = default_id if mask_problem(tokenizer, default_id) is None else spare_mask_id(tokenizer)
    fix = (f"pass --mask-token-id {pick} ({token_name(tokenizer, pick)}) or another special token that text never "
           "holds" if pick is not None else
           "add a special token to the target's tokenizer and pass its id as --mask-token-id")
    return (f"warning: mask token id {mask_id} ({token_name(tokenizer, mask_id)}) {problem}; the mask should be a "
            f"token that never appears in text: {fix}")
