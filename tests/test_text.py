"""Wording helpers: counts read as English (1 warning, 0 warnings)."""

from dflash_trt.text import count


def test_count_is_singular_only_for_one():
    assert [count(n, "warning") for n in (0, 1, 2)] == ["0 warnings", "1 warning", "2 warnings"]
    assert count(1, "KV head") == "1 KV head" and count(3, "KV head") == "3 KV heads"
    assert count(2, "child", "children") == "2 children" and count(1, "child", "children") == "1 child"
