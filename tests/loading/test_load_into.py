"""Reading any box of a tensor (read_box) and loading into an existing state (load(into=)), in one process.

The multi-process side (DTensors at another world size) is in test_collective_save.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.loading.chunkio import ChunkReader


@pytest.fixture
def sharded(tmp_path):
    """A 400 x 200 float32 tensor saved as three shards cut into 16 KiB chunks, and the same whole."""
    torch.manual_seed(0)
    full = torch.randn(400, 200)
    shards = [ckptfmt.Shard((0, 0), full[:160, :150].clone()), ckptfmt.Shard((0, 150), full[:160, 150:].clone()),
              ckptfmt.Shard((160, 0), full[160:].clone())]
    url = ckptfmt.save({"t": ckptfmt.Sharded((400, 200), shards), "whole": full}, tmp_path / "repo" / "a",
                       chunk_size=16384)
    return url, full


def test_any_box_reads_back_exactly(sharded):
    url, full = sharded
    rng = random.Random(0)
    with ckptfmt.open(url) as reader:
        for _ in range(40):
            o0, o1 = rng.randrange(400), rng.randrange(200)
            n0, n1 = rng.randint(0, 400 - o0), rng.randint(0, 200 - o1)
            for key in ("t", "whole"):
                box = reader.read_box(key, (o0, o1), (n0, n1))
                assert torch.equal(box, full[o0:o0 + n0, o1:o1 + n1]), (key, o0, o1, n0, n1)


def test_a_box_reads_only_the_chunks_that_hold_it(sharded, monkeypatch):
    url, full = sharded
    read: list[int] = []
    original = ChunkReader.read

    def spy(self, index, **kwargs):
        read.append(index)
        return original(self, index, **kwargs)
    monkeypatch.setattr(ChunkReader, "read", spy)
    with ckptfmt.open(url) as reader:
        rows = reader.read_box("whole", (390, 0), (10, 200))  # the last 8,000 bytes: in the last chunk
        assert torch.equal(rows, full[390:])
        chunks_of_whole = [p.chunk for s in reader.tensor_info("whole").shards for p in s.pieces]
        assert len(chunks_of_whole) == 20 and set(read) == {chunks_of_whole[-1]}


def test_a_box_outside_the_tensor_is_refused(sharded):
    url, _ = sharded
    with ckptfmt.open(url) as reader, pytest.raises(ckptfmt.CheckpointError, match="not inside tensor 't'"):
        reader.read_box("t", (350, 0), (100, 10))


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(1)
    model = torch.nn.Linear(30, 20)
    state = {"model": model.state_dict(), "step": 9, "pair": (1, torch.arange(4)), "table": np.arange(6.0),
             "loader": ckptfmt.PerRank({"position": 40})}
    return ckptfmt.save(state, tmp_path / "repo" / "a"), model


def fresh_state() -> dict:
    return {"model": torch.nn.Linear(30, 20).state_dict(), "step": 0, "pair": (0, torch.zeros(4, dtype=torch.int64)),
            "table": np.zeros(6), "loader": None}


def test_load_into_fills_the_state_in_place(saved):
    url, model = saved
    state = fresh_state()
    weight = state["model"]["weight"]
    loaded = ckptfmt.load(url, into=state)
    assert loaded is state and state["model"]["weight"] is weight  # the same tensor, filled
    assert torch.equal(weight, model.weight.detach())
    assert state["step"] == 9 and state["loader"] == ckptfmt.PerRank({"position": 40})
    assert state["pair"][0] == 1 and torch.equal(state["pair"][1], torch.arange(4))
    assert np.array_equal(state["table"], np.arange(6.0))


def test_load_into_lists_every_mismatch_and_changes_nothing(saved):
    url, _ = saved
    state = fresh_state()
    state["model"]["weight"] = torch.zeros(20, 31)
    state["model"]["extra"] = torch.zeros(1)
    del state["model"]["bias"]
    with pytest.raises(ckptfmt.CheckpointError) as info:
        ckptfmt.load(url, into=state)
    message = str(info.value)
    assert "1 missing from the checkpoint: model/extra" in message
    assert "1 not in the state: model/bias" in message
    assert "model/weight (saved float32 [20, 30], state float32 [20, 31])" in message
    assert state["step"] == 0 and not state["pair"][1].any()  # nothing loaded

    partial = ckptfmt.load(url, into=state, strict=False)
    assert partial["step"] == 9 and torch.equal(partial["pair"][1], torch.arange(4))
    assert not partial["model"]["weight"].any()  # mismatched: left as it was


def test_load_into_refuses_a_dtype_mismatch(saved):
    url, _ = saved
    state = fresh_state()
    state["model"]["bias"] = torch.zeros(20, dtype=torch.float64)
    with pytest.raises(ckptfmt.CheckpointError, match=r"model/bias \(saved float32 \[20\], state float64 \[20\]\)"):
        ckptfmt.load(url, into=state)


def test_within_compares_and_loads_only_the_named_entries(tmp_path):
    """A caller that reads some entries itself (Lightning's sharded strategy: the model and optimizers
    in place, the rest as values) loads the others strictly and is told of nothing else."""
    from ckptfmt.loading.load_into import load_into

    url = str(tmp_path / "repo" / "a")
    ckptfmt.save({"model": {"w": torch.arange(4.0)}, "loops": {"epoch": 3}, "extra": torch.ones(2)}, url)
    target = {"model": {"w": torch.zeros(4)}}
    with ckptfmt.open(url) as reader:
        load_into(reader, target, strict=True, rank=0, within=["model"])
        assert torch.equal(target["model"]["w"], torch.arange(4.0))
        with pytest.raises(ckptfmt.CheckpointError, match=r"missing from the checkpoint: model/b"):
            load_into(reader, {"model": {"w": torch.zeros(4), "b": torch.zeros(1)}}, strict=True, rank=0,
                      within=["model"])
        with pytest.raises(ckptfmt.CheckpointError, match=r"2 not in the state: loops, extra"):
            load_into(reader, {"model": {"w": torch.zeros(4)}}, strict=True, rank=0)  # without within


# -- PerRank values through load(into=) (issue 27, 4) --------------------------------------------
@pytest.mark.parametrize("held", [ckptfmt.PerRank({"position": -1}), {"position": -1}, None],
                         ids=["per-rank", "plain", "none"])
def test_a_per_rank_value_comes_back_per_rank_and_a_save_keeps_it(saved, tmp_path, held):
    """Whatever the state held there: a PerRank of this rank's value (the caller's own object, filled)."""
    url, _ = saved
    state = fresh_state()
    state["loader"] = held
    ckptfmt.load(url, into=state)
    assert type(state["loader"]) is ckptfmt.PerRank and state["loader"].value == {"position": 40}
    assert state["loader"] is held or not isinstance(held, ckptfmt.PerRank)
    again = ckptfmt.save(state, tmp_path / "repo" / "b")
    assert ckptfmt.load(again)["loader"] == ckptfmt.PerRankValues({0: {"position": 40}})


def test_a_failed_strict_load_leaves_per_rank_values_as_they_were(saved):
    url, _ = saved
    state = fresh_state()
    state["loader"] = ckptfmt.PerRank({"position": -1})
    state["model"]["extra"] = torch.zeros(1)
    with pytest.raises(ckptfmt.CheckpointError, match="missing from the checkpoint: model/extra"):
        ckptfmt.load(url, into=state)
    assert state["loader"].value == {"position": -1}


def test_every_ranks_values_load_into_per_rank_values(tmp_path):
    """A state as a plain load returns it holds every rank's values: load(into=) then save loses none."""
    values = ckptfmt.PerRankValues({0: {"position": 0}, 1: {"position": 1000}})
    url = ckptfmt.save({"loader": values}, tmp_path / "repo" / "a")
    state = ckptfmt.load(url)
    held = state["loader"]
    held[2] = {"position": -1}
    ckptfmt.load(url, into=state)
    assert state["loader"] is held and held == values
    assert ckptfmt.load(ckptfmt.save(state, tmp_path / "repo" / "b"))["loader"] == values


def test_a_per_rank_state_entry_stays_per_rank_for_a_value_saved_plain(tmp_path):
    url = ckptfmt.save({"loader": {"position": 7}}, tmp_path / "repo" / "a")
    state = {"loader": ckptfmt.PerRank({"position": -1})}
    ckptfmt.load(url, into=state)
    assert state["loader"] == ckptfmt.PerRank({"position": 7})


def test_a_rank_the_checkpoint_lacks_is_named_with_the_ranks_it_has(tmp_path, monkeypatch):
    """Rank 2 of 3 (the launcher's environment, no process group) and a value saved on ranks 0 and 1."""
    values = ckptfmt.PerRankValues({0: {"position": 0}, 1: {"position": 1000}})
    url = ckptfmt.save({"loader": values, "step": 5}, tmp_path / "repo" / "a")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    state = {"loader": ckptfmt.PerRank({"position": -2}), "step": 0}
    with pytest.raises(ckptfmt.CheckpointError, match=r"loader \(a PerRank value saved for ranks 0, 1: none for "
                                                      r"rank 2; with strict=False such a rank keeps its own value\)"):
        ckptfmt.load(url, into=state)
    assert state == {"loader": ckptfmt.PerRank({"position": -2}), "step": 0}
    ckptfmt.load(url, into=state, strict=False)
    assert state == {"loader": ckptfmt.PerRank({"position": -2}), "step": 5}


def test_load_into_for_a_load_state_dict_gives_the_bare_value(saved):
    """Integrations hand what they load to the framework's load_state_dict: no PerRank there."""
    from ckptfmt.loading.load_into import load_into

    url, _ = saved
    with ckptfmt.open(url) as reader:
        target = load_into(reader, {"loader": {"position": 0}}, strict=True, rank=0, within=["loader"])
    assert target == {"loader": {"position": 40}}
