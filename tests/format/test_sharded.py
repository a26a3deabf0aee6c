"""Sharded tensors: saved as shards with offsets and owning ranks, loaded assembled."""

from __future__ import annotations

import pytest
import torch

import ckptfmt
from ckptfmt import Shard, Sharded, UnsupportedValueError


def row_shards(full: torch.Tensor, parts: int) -> Sharded:
    rows = full.shape[0] // parts
    return Sharded(
        full.shape, [Shard((i * rows, 0), full[i * rows : (i + 1) * rows].clone(), rank=i) for i in range(parts)]
    )


def test_shards_are_kept_with_offsets_and_ranks(repo_url):
    full = torch.randn(8, 6)
    blocks = Sharded((8, 6), [
        Shard((0, 0), full[:4, :3].clone(), 0), Shard((0, 3), full[:4, 3:].clone(), 1),
        Shard((4, 0), full[4:, :3].clone(), 2), Shard((4, 3), full[4:, 3:].clone(), 3),
    ])
    url = ckptfmt.save({"w": blocks, "rows": row_shards(full, 2), "step": 1}, f"{repo_url}/sharded")
    with ckptfmt.open(url) as reader:
        info = reader.tensor_info("w")
        assert [(s.offsets, s.shape, s.rank) for s in info.shards] == [
            ((0, 0), (4, 3), 0), ((0, 3), (4, 3), 1), ((4, 0), (4, 3), 2), ((4, 3), (4, 3), 3)]
        assert torch.equal(reader.get_tensor("w"), full)
    state = ckptfmt.load(url)
    assert torch.equal(state["w"], full) and torch.equal(state["rows"], full) and state["step"] == 1
    assert ckptfmt.verify(url).ok


def test_many_shards_in_a_grid(tmp_path):
    full = torch.arange(300 * 2, dtype=torch.int32).reshape(300, 2)
    url = ckptfmt.save({"t": row_shards(full, 300)}, tmp_path / "repo" / "grid")
    assert torch.equal(ckptfmt.load(url)["t"], full)


@pytest.mark.parametrize("shards, message", [
    ([Shard((0,), torch.ones(3)), Shard((2,), torch.ones(3))], "overlap|cover"),
    ([Shard((0,), torch.ones(3))], "cover"),
    ([Shard((0,), torch.ones(3)), Shard((3,), torch.ones(3, dtype=torch.int64))], "dtypes"),
    ([Shard((4,), torch.ones(3)), Shard((0,), torch.ones(3))], "outside|cover"),
    ([], "at least one"),
])
def test_bad_layouts_are_refused_before_writing(tmp_path, shards, message):
    with pytest.raises(UnsupportedValueError, match=message):
        ckptfmt.save({"t": Sharded((6,), shards)}, tmp_path / "repo" / "bad")
    assert not (tmp_path / "repo" / "bad" / "COMMIT").exists()
