"""Details a reader written from the spec alone found the text silent on (issue 47, part 5), held to what the
text now says: a chunk cut at whole elements (5.2), a progress key's numbers (4.6), a history object's
required members (4.5)."""

from __future__ import annotations

import msgpack
import pytest
import torch

import ckptfmt
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.history import History, HistoryKey
from ckptfmt.format.progress import ProgressKey


@pytest.mark.parametrize("chunk_size", [4097, 4098, 5000])
def test_a_big_tensors_chunks_hold_whole_elements(tmp_path, chunk_size):
    """Spec 5.2: chunk_size rounded down to a multiple of the element size (8 bytes here)."""
    ckptfmt.save({"w": torch.arange(40_000, dtype=torch.float64)}, tmp_path / "repo" / "a")
    ckptfmt.save({"w": torch.arange(40_000, dtype=torch.float64) + 1}, tmp_path / "repo" / "b",
                 chunk_size=chunk_size)
    with ckptfmt.open(tmp_path / "repo" / "b") as reader:
        sizes = [chunk.size for chunk in reader.manifest.chunks]
    whole = chunk_size - chunk_size % 8
    assert sizes == [whole] * (320_000 // whole) + ([320_000 % whole] if 320_000 % whole else [])


def test_a_progress_keys_numbers_are_decimal_whatever_their_zeros():
    assert ProgressKey(1_700_000_000_000_000_000, 7, 42).key == "_progress/1700000000000000000.7.42.msgpack"
    assert ProgressKey.parse("1700000000000000000.007.0042.msgpack") == ProgressKey(1_700_000_000_000_000_000, 7, 42)
    assert ProgressKey.parse("1700000000000000000.12345678901.1.msgpack") is None  # 11 digits


def _history_bytes(**fields) -> tuple[bytes, HistoryKey]:
    doc = {"format": "ckptfmt-history", "version": [2, 0], "requires": [], "name": "step-1",
           "manifest": "ab" * 32, "step": 1, "created_ns": 5, "parent": None, "world_size": None, "timing": {}}
    doc.update(fields)
    doc = {k: v for k, v in doc.items() if v is not _ABSENT}
    data = msgpack.packb(doc, use_bin_type=True)
    return data, HistoryKey(5, "step-1", chunk_hash(data))


_ABSENT = object()


def test_a_history_object_without_optional_members_reads_as_nil():
    """Spec 4.5: step, parent, world_size and timing may be absent (nil); timing may be nil."""
    data, key = _history_bytes(step=_ABSENT, parent=_ABSENT, world_size=_ABSENT, timing=None)
    history = History.from_bytes(data, key, "here")
    assert (history.step, history.parent, history.world_size, history.timing) == (None, None, None, {})


@pytest.mark.parametrize("member", ["name", "manifest", "created_ns"])
def test_a_history_object_without_a_required_member_is_damaged(member):
    data, key = _history_bytes(**{member: _ABSENT})
    with pytest.raises(ckptfmt.CheckpointError):
        History.from_bytes(data, key, "here")


@pytest.mark.parametrize("member, value", [("step", "1"), ("world_size", 0), ("timing", [1]), ("parent", 3)])
def test_a_history_member_of_another_type_is_damaged(member, value):
    data, key = _history_bytes(**{member: value})
    with pytest.raises((ckptfmt.ManifestError, ckptfmt.InvalidNameError)):
        History.from_bytes(data, key, "here")
