"""``PerRank`` values survive ``load(into=)`` then a save, on real gloo ranks (issue 27, 4).

A value saved as ``ckptfmt.PerRank`` comes back through ``load(url, into=state)``
as a ``PerRank`` of this rank's own value, whatever the state held there, so the
next save (sync or async, collective) keeps every rank's value again. A rank the
checkpoint has no value for (more ranks than saved) is an error on every rank,
or, with ``strict=False``, keeps its own value.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ckptfmt
from tests.project.test_docs_examples import bucket, examples, run_example  # noqa: F401 (bucket: a fixture, used by name)
from tests.support.ranks import run_ranks

TIMEOUT_S = 60
#: The entries saved per rank, each loaded into a state that holds something else there.
HELD = {"as_per_rank": lambda: ckptfmt.PerRank({"position": -1}), "as_plain": lambda: {"position": -1},
        "as_none": lambda: None}


def documented_example():
    """The torchrun example of docs/distributed.md, as written there."""
    (found,) = [e for e in examples() if e.where.startswith("docs/distributed.md") and "into=state" in e.code]
    assert found.ranks == 2
    return found


@pytest.mark.usefixtures("bucket")  # the example's s3://bucket
def test_the_documented_example_keeps_each_ranks_loader(tmp_path):
    """Saved, loaded into the same state, saved again asynchronously: each rank's position stays its own."""
    result = run_example(documented_example(), tmp_path)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert "ranks saved different values" not in result.stderr, result.stderr[-6000:]
    loaded = ckptfmt.load(tmp_path / "runs" / "a" / "step-000101")
    assert loaded["loader"] == ckptfmt.PerRankValues({0: {"position": 0}, 1: {"position": 1000}})


def position(rank: int) -> dict:
    return {"position": 1000 * rank}


def load_then_save(rank: int, world: int, folder: Path, repo: str) -> dict:
    """Save per-rank values, load them into states holding a PerRank, a plain value and None there,
    then save again, sync and async: what each entry came back as."""
    ckptfmt.save({key: ckptfmt.PerRank(position(rank)) for key in HELD}, f"{repo}/a", timeout=TIMEOUT_S)
    state = {key: held() for key, held in HELD.items()}
    kept = state["as_per_rank"]
    ckptfmt.load(f"{repo}/a", into=state)
    ckptfmt.save(state, f"{repo}/b", timeout=TIMEOUT_S)
    ckptfmt.async_save(state, f"{repo}/c", timeout=TIMEOUT_S).result(timeout=TIMEOUT_S)
    return {"types": {key: type(value).__name__ for key, value in state.items()},
            "values": {key: getattr(value, "value", value) for key, value in state.items()},
            "in_place": state["as_per_rank"] is kept}


def test_load_into_then_save_keeps_every_ranks_value(tmp_path):
    repo = str(tmp_path / "repo")
    outcomes = [o.unwrap() for o in run_ranks(load_then_save, 2, tmp_path / "ranks", timeout=120, repo=repo)]
    for rank, outcome in enumerate(outcomes):
        assert outcome["types"] == dict.fromkeys(HELD, "PerRank"), rank
        assert outcome["values"] == dict.fromkeys(HELD, position(rank)), rank
        assert outcome["in_place"], rank
    for name in ("b", "c"):
        loaded = ckptfmt.load(f"{repo}/{name}")
        assert loaded == {key: ckptfmt.PerRankValues({0: position(0), 1: position(1)}) for key in HELD}, name


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory) -> str:
    """A checkpoint whose ``loader`` was saved per rank on 2 ranks."""
    folder = tmp_path_factory.mktemp("two")
    url = str(folder / "repo" / "a")
    values = ckptfmt.PerRankValues({0: position(0), 1: position(1)})
    ckptfmt.save({"loader": values, "step": 5}, url)  # as 2 ranks store it
    return url


def test_one_process_gets_rank_zeros_value(saved_on_two, tmp_path):
    """No process group: rank 0's value, as a PerRank that a save keeps; rank 1's is not loaded."""
    state = {"loader": None, "step": 0}
    ckptfmt.load(saved_on_two, into=state)
    assert state["loader"] == ckptfmt.PerRank(position(0)) and state["step"] == 5
    ckptfmt.save(state, tmp_path / "repo" / "b")
    assert ckptfmt.load(tmp_path / "repo" / "b")["loader"] == ckptfmt.PerRankValues({0: position(0)})


def load_on_more_ranks(rank: int, world: int, folder: Path, url: str, repo: str) -> dict:
    """Strict: every rank refuses the checkpoint. Not strict: ranks 0 and 1 get theirs, rank 2 keeps its
    own; a save then holds each rank's."""
    state = {"loader": ckptfmt.PerRank({"position": -rank}), "step": 0}
    try:
        ckptfmt.load(url, into=state)
    except ckptfmt.CheckpointError as exc:
        error = str(exc)
    unchanged = state["loader"].value == {"position": -rank} and state["step"] == 0
    ckptfmt.load(url, into=state, strict=False)
    ckptfmt.save(state, f"{repo}/b", timeout=TIMEOUT_S)
    return {"error": error, "unchanged": unchanged, "loader": state["loader"].value, "step": state["step"]}


def test_a_rank_the_checkpoint_has_no_value_for_is_refused_on_every_rank(saved_on_two, tmp_path):
    repo = str(tmp_path / "repo")
    outcomes = [o.unwrap() for o in run_ranks(load_on_more_ranks, 3, tmp_path / "ranks", timeout=120,
                                              url=saved_on_two, repo=repo)]
    for rank, outcome in enumerate(outcomes):
        assert "loader (a PerRank value saved for ranks 0, 1: none for rank 2" in outcome["error"], outcome
        assert outcome["unchanged"], rank
        assert outcome["step"] == 5, rank
    assert [o["loader"] for o in outcomes] == [position(0), position(1), {"position": -2}]
    loaded = ckptfmt.load(f"{repo}/b")
    assert loaded["loader"] == ckptfmt.PerRankValues({0: position(0), 1: position(1), 2: {"position": -2}})
