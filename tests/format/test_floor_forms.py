"""The forms a save with ``format_version=`` writes, checked on the bytes without the old trees (the
exhaustive tests/format/test_version_matrix.py has each version's own ckptfmt read them).

Python's generator state is written as 625 ints up to 1.13 and as a bin of words from 1.14: format 1.13
has the bin (spec 9.1), but the commit that introduced 1.13 restores only the ints, and its
``restore_rng`` failed on a floor-1.13 checkpoint ("malformed RNG state (state vector is the wrong size)").
"""

from __future__ import annotations

import random
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

import ckptfmt


def seed_generators(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def draws() -> list[float]:
    return [random.random(), float(np.random.random()), torch.rand(1, dtype=torch.float64).item()]


def python_state(url: str):
    """The Python generator state of a local checkpoint's rank-0 RNG entry, as its manifest stores it."""
    (path,) = Path(url).glob("manifest-*.msgpack")
    doc = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    (entry,) = [e for e in doc["rng"] if e["rank"] == 0]
    return entry["python"]["state"]


@pytest.mark.parametrize(("version", "words"), [("1.12", False), ("1.13", False), ("1.14", True), ("1.15", True),
                                                (None, True)])
def test_python_generator_states_are_ints_up_to_1_13_and_words_after(tmp_path, version, words):
    floor = {"format_version": version} if version else {}
    seed_generators(7)
    url = ckptfmt.save({"w": torch.ones(3)}, f"{tmp_path}/repo/ckpt", **floor)
    seed_generators(7)
    expected = draws()
    state = python_state(url)
    if words:
        assert type(state) is bytes and len(state) == 625 * 4
    else:
        assert type(state) is list and len(state) == 625 and all(type(word) is int for word in state)
    seed_generators(0)
    ckptfmt.restore_rng(url)
    assert draws() == expected
