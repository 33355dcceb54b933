"""One JSON value read from a text that grows (a streamed answer), written canonically as far as it is sure.

`JsonReader` reads the value token by token, each character once, and keeps the canonical text of the tokens it
has read whole: what `json.dumps(value, ensure_ascii=False)` writes for the value Python's `json` reads (", " and
": " between items, strings re-escaped, numbers as Python writes them), but for a lone surrogate (`"\\ud800"`),
which stays an escape (`ensure_ascii=False` would write the character itself, which UTF-8 cannot encode: the
response could not be sent). A token the text may still extend (a number, a literal, an escape) waits for the
next text (a number's characters so far are kept, so a long one is not read again from its start at each delta);
a string's characters are written as they come. So the canonical text only ever grows, and the canonical text of a
whole value is the concatenation of what was read piece by piece, however the text was cut.
The canonical text is kept as its pieces (`dflash_trt.text.GrowingText`): a reader that takes what is new since an
offset (`written`) does work linear in the value's length, as `read` does given only the text from `pos` on
(`base`).

It differs from Python's `json` in one way, to keep that property: a key repeated in one object (which Python
reads as its last value, at its first place) is not JSON here (`NotJson`).
"""

from __future__ import annotations

import json
import re

from dflash_trt.text import GrowingText

_WS = re.compile(r"[ \t\n\r]*")
#: string characters written as they are (JSON's escapes are the only other characters a string may hold)
_PLAIN = re.compile(r'[^"\\\x00-\x1f\ud800-\udfff]+')
#: the characters a number may hold: a number is whole once a character outside them follows it
_NUMBER_RUN = re.compile(r"[-+0-9.eE]*")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_HEX = re.compile(r"[0-9a-fA-F]*")
#: the canonical text of each one-character escape
_ESCAPES = {'"': '\\"', "\\": "\\\\", "/": "/", "b": "\\b", "f": "\\f", "n": "\\n", "r": "\\r", "t": "\\t"}
_LITERALS = ("true", "false", "null")
#: what the reader expects next
_VALUE, _VALUE_OR_END, _KEY, _KEY_OR_END, _COLON, _NEXT = range(6)


class NotJson(ValueError):
    """The text cannot go on as the JSON value (or, read to its end, left the value unfinished)."""


def _char(c: str) -> str:
    """The canonical text of one string character (JSON-escaped as `json.dumps(..., ensure_ascii=False)` does; a
    lone surrogate as its escape, which UTF-8 can carry)."""
    if "\ud800" <= c <= "\udfff":
        return f"\\u{ord(c):04x}"
    return json.dumps(c, ensure_ascii=False)[1:-1]


class JsonReader:
    """One JSON value of a growing text, from position `start` (whitespace before it is skipped): call `read` with
    the text each time it grows (the whole text, or the text from `pos` on with `base`).

    Attributes:
        out: the canonical text of what was read whole (it only grows; a `str` joined on each call: while the text
            grows, take parts with `written` and the length with `out_len`).
        pos: where reading goes on (past the characters of a number not yet whole: they are kept); once `done`,
            just after the value.
        done: whether the value is whole.
        members: when the value is an object, its members so far, each [key, start, end]: where the member's
            value starts and ends in `out` (None while unknown).
    """

    def __init__(self, start: int = 0, object_only: bool = False):
        self._out, self.pos, self.done, self.members = GrowingText(), start, False, []
        self.object_only = object_only  # the value must be an object
        self._stack: list[set | None] = []  # the open objects (their keys) and arrays (None)
        self._expect = _VALUE
        self._string: str | None = None  # inside a string: "key" or "value"
        self._string_start = 0  # where the string's text starts in `out`
        self._number: list[str] | None = None  # inside a number that may go on: its characters so far

    @property
    def out(self) -> str:
        return str(self._out)

    @property
    def out_len(self) -> int:
        """The length of `out` (without joining it)."""
        return len(self._out)

    def written(self, a: int, b: int | None = None) -> str:
        """`out[a:b]` (0 <= a; b None: to the end), in time linear in its length."""
        return self._out.slice(a, b)

    def read(self, text: str, final: bool = False, base: int = 0) -> None:
        """Read the text so far (what was read before plus more) on from `pos`, as far as it goes: `text` is the
        text from position `base` on (`base` <= `pos`; 0: the whole text). `final`: the text ends here (a number at
        its end is whole; a value left unfinished is an error).

        Raises:
            NotJson: at the first character that cannot go on as the value (`out` keeps what was read before it);
                with `final`, also when the value is unfinished.
        """
        if base > self.pos:
            raise ValueError(f"the text given starts at {base}, after where reading goes on ({self.pos})")
        self.pos -= base  # (reading only looks on from `pos`: positions in `text` while reading)
        try:
            self._read(text, final)
        finally:
            self.pos += base

    def _read(self, text: str, final: bool) -> None:
        while not self.done:
            if self._string is not None:
                if not self._read_string(text):
                    break
                continue
            if self._number is not None:  # (no whitespace skipped: it would end the number)
                if not self._read_number(text, final):
                    break
                continue
            self.pos = _WS.match(text, self.pos).end()
            if self.pos >= len(text) or not self._read_token(text, final):
                break
        if final and not self.done:
            raise NotJson("the text ended inside the value")

    def _write(self, canonical: str) -> None:
        self._out.append(canonical)

    def _read_token(self, text: str, final: bool) -> bool:
        """Read the token at `pos` (not whitespace); False when the text may still extend it (wait for more)."""
        c, expect = text[self.pos], self._expect
        if expect in (_VALUE, _VALUE_OR_END):
            if c == "]" and expect == _VALUE_OR_END:
                return self._close("]")
            if self.object_only and not self._stack and c != "{":
                raise NotJson("not an object")
            if c in "{[":
                self._write(c)
                self.pos += 1
                self._stack.append(set() if c == "{" else None)
                self._expect = _KEY_OR_END if c == "{" else _VALUE_OR_END
                return True
            if c == '"':
                return self._open_string("value")
            if c in "-0123456789":  # (str.isdigit would take other scripts' digits: not JSON)
                return self._read_number(text, final)
            return self._read_literal(text)
        if expect in (_KEY, _KEY_OR_END):
            if c == "}" and expect == _KEY_OR_END:
                return self._close("}")
            if c == '"':
                return self._open_string("key")
            raise NotJson("expected a key")
        if expect == _COLON:
            if c != ":":
                raise NotJson("expected ':'")
            self._write(": ")
            self.pos += 1
            self._expect = _VALUE
            if len(self._stack) == 1:
                self.members[-1][1] = len(self._out)
            return True
        # _NEXT: after an item
        if c == ",":
            self._write(", ")
            self.pos += 1
            self._expect = _KEY if self._stack[-1] is not None else _VALUE
            return True
        return self._close(c)

    def _close(self, c: str) -> bool:
        if c != ("}" if self._stack[-1] is not None else "]"):
            raise NotJson(f"unexpected {c!r}")
        self._write(c)
        self.pos += 1
        self._stack.pop()
        self._value_done()
        return True

    def _value_done(self) -> None:
        if not self._stack:
            self.done = True
            return
        self._expect = _NEXT
        if len(self._stack) == 1 and self.members:
            self.members[-1][2] = len(self._out)

    def _read_number(self, text: str, final: bool) -> bool:
        """Read the number at `pos` (or go on with the one begun); False when the text may still extend it: its
        characters so far are kept and `pos` goes past them (each character read once)."""
        end = _NUMBER_RUN.match(text, self.pos).end()
        if end == len(text) and not final:
            if self._number is None:
                self._number = []
            self._number.append(text[self.pos:end])
            self.pos = end
            return False
        token = "".join(self._number or ()) + text[self.pos:end]
        self._number = None
        if not _NUMBER.fullmatch(token):
            raise NotJson(f"not a number: {token!r:.40}")
        try:  # Python's number text (1E2 is 100.0); too many digits, or a float beyond range: not read
            self._write(json.dumps(json.loads(token), allow_nan=False))
        except ValueError:
            raise NotJson(f"a number Python cannot read: {token[:40]}...") from None
        self.pos = end
        self._value_done()
        return True

    def _read_literal(self, text: str) -> bool:
        for word in _LITERALS:
            if text.startswith(word, self.pos):
                self._write(word)
                self.pos += len(word)
                self._value_done()
                return True
        rest = text[self.pos:self.pos + 5]
        if len(rest) < 5 and self.pos + len(rest) == len(text) and any(w.startswith(rest) for w in _LITERALS):
            return False
        raise NotJson(f"not a JSON value: {rest!r}")

    def _open_string(self, kind: str) -> bool:
        self._string, self._string_start = kind, len(self._out)
        self._write('"')
        self.pos += 1
        return True

    def _read_string(self, text: str) -> bool:
        """Read the string's characters on from `pos`; False when the text ends first (inside it, or inside an
        escape, or after a high surrogate's escape that a low one may follow: they make one character)."""
        while True:
            m = _PLAIN.match(text, self.pos)
            if m is not None:
                self._write(m.group())
                self.pos = m.end()
            if self.pos >= len(text):
                return False
            c = text[self.pos]
            if "\ud800" <= c <= "\udfff":  # a lone surrogate as it is (from JSON text in a string): its escape
                self._write(_char(c))
                self.pos += 1
                continue
            if c == '"':
                self._write('"')
                self.pos += 1
                self._string_done()
                return True
            if c != "\\":
                raise NotJson("a control character in a string")
            if self.pos + 1 >= len(text):
                return False
            e = text[self.pos + 1]
            if e in _ESCAPES:
                self._write(_ESCAPES[e])
                self.pos += 2
                continue
            if e != "u":
                raise NotJson(f"the escape \\{e}")
            code, n = self._hex4(text, self.pos + 2)
            if code is None:
                return False
            if 0xD800 <= code <= 0xDBFF:  # a low surrogate's escape right after makes one character with it
                after = text[n:n + 2]
                if len(after) < 2 and "\\u".startswith(after):
                    return False
                if after == "\\u":
                    low, m_end = self._hex4(text, n + 2)
                    if low is None:
                        return False
                    if 0xDC00 <= low <= 0xDFFF:
                        code, n = 0x10000 + ((code - 0xD800) << 10 | (low - 0xDC00)), m_end
            self._write(_char(chr(code)))
            self.pos = n

    @staticmethod
    def _hex4(text: str, i: int) -> tuple[int | None, int]:
        """(the code of the 4 hex digits at `i`, the position after them); (None, i) when the text ends first."""
        digits = text[i:i + 4]
        if _HEX.fullmatch(digits) is None:
            raise NotJson(f"the escape \\u{digits}")
        if len(digits) < 4:
            return None, i
        return int(digits, 16), i + 4

    def _string_done(self) -> None:
        kind, self._string = self._string, None
        if kind == "value":
            self._value_done()
            return
        key = json.loads(self._out.slice(self._string_start))
        keys = self._stack[-1]
        if key in keys:
            raise NotJson(f"the key {key!r:.40} twice in one object")
        keys.add(key)
        if len(self._stack) == 1:
            self.members.append([key, None, None])
        self._expect = _COLON
