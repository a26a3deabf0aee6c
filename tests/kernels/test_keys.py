"""The C key checks against Python's (ckptfmt/kernels/keys.py, issue 49 part 3): the same stray item,
empty count and over-long key for keys of every string width (ASCII, Latin-1, the BMP with lone
surrogates, astral planes), the same first repeated key wherever it is, and a run of keys of one hash tag
decided by Python's set. (tests/format/test_tensor_columns.py: an open refuses bad keys alike either way.)"""

from __future__ import annotations

import random

import pytest

from ckptfmt.format.limits import MAX_KEY_BYTES
from ckptfmt.kernels import keys as key_checks

NATIVE = key_checks._native is not None
pytestmark = pytest.mark.skipif(not NATIVE, reason="the C key checks are not built here")
WIDE = ["a", "ä", "€", "\ud800", "😀"]  # 1, 2, 3, 3 (surrogatepass) and 4 bytes of UTF-8


def both(function: str, *args):
    """(C's answer, Python's answer) of ``keys.function(*args)``."""
    native = getattr(key_checks, function)(*args)
    kept = key_checks._native
    key_checks._native = None
    try:
        return native, getattr(key_checks, function)(*args)
    finally:
        key_checks._native = kept


def random_keys(rng: random.Random, count: int, longest: int) -> list[str]:
    return ["".join(rng.choice(WIDE) for _ in range(rng.randrange(0, longest))) + f".{i}" * rng.randrange(2)
            for i in range(count)]


@pytest.mark.parametrize("seed", range(8))
def test_the_scan_counts_what_python_counts_for_keys_of_every_width(seed):
    rng = random.Random(seed)
    keys = random_keys(rng, 300, 40)
    keys[rng.randrange(300)] = ""
    for limit in (4, 9, 16, 40, 160):
        native, python = both("key_scan", keys, limit)
        exact = [len(key.encode("utf-8", "surrogatepass")) for key in keys]
        assert native == python == (-1, exact.count(0), next((i for i, n in enumerate(exact) if n > limit), -1))


@pytest.mark.parametrize("stray", [0, 1, 150, 299])
@pytest.mark.parametrize("item", [None, b"bytes", 7, ["nested"]])
def test_the_scan_stops_at_the_first_item_that_is_not_a_string(stray, item):
    keys = random_keys(random.Random(stray), 300, 8)
    keys[stray] = item
    keys.append(None)
    native, python = both("key_scan", keys, MAX_KEY_BYTES)
    assert native == python
    assert native[0] == stray and native[1] == keys[:stray].count("")


def test_a_key_of_exactly_the_limit_passes_and_one_byte_more_does_not():
    for char in WIDE:
        width = len(char.encode("utf-8", "surrogatepass"))
        fits = char * (MAX_KEY_BYTES // width)
        over = fits + "x" * (MAX_KEY_BYTES - len(fits.encode("utf-8", "surrogatepass")) + 1)
        for keys, expected in (([fits, "b"], -1), (["b", over, over], 1)):
            native, python = both("key_scan", keys, MAX_KEY_BYTES)
            assert native == python == (-1, 0, expected), char


@pytest.mark.parametrize("seed", range(6))
def test_the_first_repeat_is_the_first_key_equal_to_an_earlier_one(seed):
    rng = random.Random(seed)
    keys = list(dict.fromkeys(random_keys(rng, 5000, 12)))
    assert both("first_repeat", keys) == (None, None)
    for _ in range(3):
        later = rng.randrange(1, len(keys))
        keys.insert(later, keys[rng.randrange(later)])
        expected = next(i for i, key in enumerate(keys) if key in keys[:i])
        assert both("first_repeat", keys) == (expected, expected)


def test_keys_alike_but_for_their_width_or_length_are_not_repeats():
    keys = ["a", "a\0", "\0a", "ä", "a" * 8, "a" * 9, "a" * 16, "a" * 17, "😀", "\ud83d\ude00", ""]
    assert both("first_repeat", keys) == (None, None)
    assert both("first_repeat", keys + ["a" * 16]) == (len(keys), len(keys))


def test_a_long_run_of_one_hash_tag_is_decided_by_the_set():
    """Seventeen equal keys are seventeen equal tags: C hands the decision over (-2), and it is the same."""
    keys = [f"k{i}" for i in range(100)] + ["same"] * 17
    assert key_checks._native.first_repeat(keys) == -2
    assert both("first_repeat", keys) == (101, 101)


def test_the_checks_refuse_what_is_not_a_list_of_strings():
    with pytest.raises(TypeError):
        key_checks._native.first_repeat(["a", 1])
    with pytest.raises(TypeError):
        key_checks._native.first_repeat(("a", "b"))
    with pytest.raises(TypeError):
        key_checks._native.key_scan(("a",), 10)
