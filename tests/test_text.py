"""Wording helpers: counts read as English (1 warning, 0 warnings)."""

from dflash_trt.text import count


def test_count_is_singular_only_for_one():
    assert [count(n, "warning") for n in (0, 1, 2)] == ["0 warnings", "1 warning", "2 warnings"]
    assert count(1, "KV head") == "1 KV head" and count(3, "KV head") == "3 KV heads"
    assert count(2, "child", "children") == "2 children" and count(1, "child", "children") == "1 child"


def test_invalid_unicode_names_a_lone_surrogate_or_a_non_utf8_argv_byte():
    from dflash_trt.text import invalid_unicode

    assert invalid_unicode("plain, café, 😀, \u2028") is None
    assert invalid_unicode("ab\ud800c") == "an unpaired surrogate (U+D800) at character 3, which is not a character"
    assert invalid_unicode("x\udfff") == "an unpaired surrogate (U+DFFF) at character 2, which is not a character"
    # a command-line byte 0xff that is not UTF-8 arrives as U+DCFF (PEP 383): named as the byte there only
    assert invalid_unicode("caf\udcff", from_argv=True) == "a byte that is not UTF-8 (0xff) at character 4"
    assert invalid_unicode("caf\udcff").startswith("an unpaired surrogate (U+DCFF) at character 4")
