"""Collective saves on real multi-process torch.distributed runs (gloo, 4 ranks, CPU).

Each scenario below runs on every rank (tests/support/ranks.py spawns them); the tests
then read the checkpoint in this process, without a process group.
"""

from __future__ import annotations

import random
import time
import warnings
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.format.layout import commit_key
from ckptfmt.metadata.step_timer import decode_steps
from ckptfmt.metadata.system import decode_samples
from ckptfmt.saving import pipeline
from tests.support.ranks import mixed_state, run_ranks, save_mixed_state
from tests.support.tensor_values import assert_stats_close, expected_stats

WORLD = 4


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixed")
    outcomes = run_ranks(save_mixed_state, WORLD, folder, repo=str(folder / "repo"))
    results = [o.unwrap() for o in outcomes]
    return results, ckptfmt.open(results[0]["url"])


def test_every_rank_gets_the_committed_checkpoint(mixed):
    results, reader = mixed
    assert {r["url"] for r in results} == {reader.url}
    assert ckptfmt.verify(reader.url).ok


def test_replicated_tensors_are_stored_once_and_dtensors_as_their_shards(mixed):
    results, reader = mixed
    full = results[0]["full"]
    state = ckptfmt.load(reader.url)
    for i, layer in enumerate(full["layers"]):
        assert torch.equal(state["model"]["layers"][i], layer)
        assert len(reader.tensor_info(f"model/layers/{i}").shards) == 1
    for key in ("row", "grid", "half"):
        assert torch.equal(state["model"][key], full[key]), key
    shards = {key: reader.tensor_info(f"model/{key}").shards for key in ("row", "grid", "half")}
    assert [s.shape for s in shards["row"]] == [(3, 3), (3, 3), (3, 3), (1, 3)]  # uneven, as torch cuts it
    assert sorted(s.rank for s in shards["row"]) == [0, 1, 2, 3]  # each rank wrote its own shard
    assert len(shards["grid"]) == 4
    assert [s.offsets for s in shards["half"]] == [(0, 0), (4, 0)]  # replicated over dp: each box once


def test_each_tensors_statistics_merge_its_ranks_shards_exactly(mixed):
    """Every rank measures the boxes it writes; the coordinator merges them per tensor (spec 6.10)."""
    results, reader = mixed
    state = ckptfmt.load(reader.url)
    sharded = 0
    for key in reader.keys():
        value = state
        for part in key.split("/"):
            value = value[int(part)] if isinstance(value, list) else value[part]
        if not isinstance(value, torch.Tensor):
            continue
        sharded += len({s.rank for s in reader.tensor_info(key).shards}) > 1
        assert_stats_close(expected_stats(value), reader.tensor_stats(key), key)
    assert sharded >= 2  # tensors written by several ranks were merged
    assert ckptfmt.verify(reader.url, stats=True).ok


def test_replicated_bytes_are_spread_over_the_ranks(mixed):
    _, reader = mixed
    written = [0] * WORLD
    for key in reader.keys():
        for shard in reader.tensor_info(key).shards:
            written[shard.rank] += sum(p.length for p in shard.pieces)
    layer = 64 * 1024 * 4
    assert max(written) - min(written) <= layer, written  # 8 layers over 4 ranks: 2 each, give or take one
    assert reader.metadata["topology"]["writer_ranks"] == [0, 1, 2, 3]


def test_plain_values_come_from_the_coordinator_and_differences_are_reported(mixed):
    results, reader = mixed
    state = ckptfmt.load(reader.url)
    assert state["step"] == 7 and state["seen_by"] == "rank-0"
    assert state["loader"] == ckptfmt.PerRankValues({r: {"position": 100 * r} for r in range(WORLD)})
    reported = [w for w in results[0]["warnings"] if "differ" in w]
    assert len(reported) == 1 and "state['seen_by']" in reported[0] and "ckptfmt.PerRank" in reported[0]


def test_metadata_records_every_rank(mixed):
    _, reader = mixed
    meta = reader.metadata
    topology = meta["topology"]
    assert topology["world_size"] == WORLD and topology["backend"] == "gloo"
    assert [r["rank"] for r in topology["ranks"]] == [0, 1, 2, 3]
    assert len({r["pid"] for r in topology["ranks"]}) == WORLD
    assert {"shape": [2, 2], "dim_names": ["dp", "tp"]} in topology["meshes"]
    assert topology["parallelism"] == {"dp": 2, "tp": 2}
    assert [e["rank"] for e in meta["rng"]] == [0, 1, 2, 3]
    assert meta["environment"]["ranks"] == [0, 1, 2, 3]  # one host, one environment
    timing = meta["timing"]["ranks"]
    assert [t["rank"] for t in timing] == [0, 1, 2, 3]
    for record in timing:
        names = [p["name"] for p in record["phases"]]
        assert names[:5] == ["join", "prepare", "plan", "write_chunks", "sync"], names
    assert "wait_ranks" in [p["name"] for p in timing[0]["phases"]]  # the coordinator's wait for all
    steps = [decode_steps(record["steps"], f"rank {rank}") for rank, record in enumerate(timing)]
    for rank, columns in enumerate(steps):  # every rank's training steps, gathered by the save
        assert columns.step.tolist() == list(range(rank + 1)) and columns.batch_size.tolist() == [1] * (rank + 1)
    assert len({columns.batch[0].tobytes() for columns in steps}) == WORLD
    samples = [decode_samples(record["system"], f"rank {rank}") for rank, record in enumerate(timing)]
    # Each rank sampled its own process from its first step, before it saved.
    for record, sample in zip(timing, samples):
        assert sample.count >= 1 and sample.fields["rss_bytes"][0] > 0 and sample.fields["cpu_user_s"][0] > 0
        assert sample.time_ns[0] <= record["start_ns"]
    stats = meta["stats"]
    assert stats["new_bytes"] == stats["stored_bytes"] > 8 * 64 * 1024 * 4


# -- loading at another world size -------------------------------------------------------------
def load_resharded(rank: int, world: int, folder: Path, url: str) -> dict:
    """Load the 4-rank checkpoint into DTensors on a 1-D mesh of this world size (uneven shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {
        "model": {
            "layers": [torch.zeros(64, 1024) for _ in range(8)],
            "bias": torch.zeros(10),
            "row": distribute_tensor(torch.zeros(10, 3), mesh, [Shard(0)]),
            "grid": distribute_tensor(torch.zeros(6, 8), mesh, [Shard(1)]),
            "half": distribute_tensor(torch.zeros(7, 5), mesh, [Shard(0)]),
        },
        "step": 0, "loader": None, "seen_by": None,
    }
    loaded = ckptfmt.load(url, into=state)
    assert loaded is state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckptfmt.restore_rng(url)
    model = state["model"]
    return {
        "next_random": random.random(),
        "warnings": [str(w.message) for w in caught],
        "full": {key: model[key].full_tensor() for key in ("row", "grid", "half")},
        "local_shapes": [tuple(model[key].to_local().shape) for key in ("row", "grid", "half")],
        "layers": model["layers"],
        "bias": model["bias"],
        "step": state["step"],
        "loader": state["loader"],
        "seen_by": state["seen_by"],
    }


@pytest.mark.parametrize("world", [2, 3])
def test_a_checkpoint_saved_on_4_ranks_loads_into_dtensors_on_fewer(mixed, tmp_path, world):
    results, reader = mixed
    full = results[0]["full"]
    outcomes = [o.unwrap() for o in run_ranks(load_resharded, world, tmp_path, url=reader.url)]
    for rank, loaded in enumerate(outcomes):
        for key in ("row", "grid", "half"):
            assert torch.equal(loaded["full"][key], full[key]), (rank, key)
        for got, want in zip(loaded["layers"], full["layers"]):
            assert torch.equal(got, want)
        assert torch.equal(loaded["bias"], full["bias"])
        assert (loaded["step"], loaded["seen_by"]) == (7, "rank-0")
        assert loaded["loader"] == ckptfmt.PerRank({"position": 100 * rank})  # this rank's own, still per rank
        assert loaded["next_random"] == results[rank]["next_random"]  # this rank's RNG restored
    assert outcomes[0]["warnings"] == [f"{reader.url}: saved with RNG states for ranks 0-3; resuming on {world} "
                                       f"rank(s), the states of {'ranks 2, 3' if world == 2 else 'rank 3'} are "
                                       "not restored"]
    if world == 3:
        assert [o["local_shapes"][0] for o in outcomes] == [(4, 3), (4, 3), (2, 3)]  # uneven


def test_restoring_rng_for_a_rank_the_checkpoint_lacks_names_the_ranks_it_has(mixed):
    _, reader = mixed
    with pytest.raises(ckptfmt.CheckpointNotFoundError, match="no RNG state recorded for rank 7; the checkpoint "
                                                              "has states for ranks 0-3"):
        ckptfmt.restore_rng(reader.url, rank=7)


def async_save_then_train(rank: int, world: int, folder: Path, repo: str) -> dict:
    """async_save returns once staged; the state changes at once; the checkpoint has the state at the call."""
    state, full = mixed_state(rank, world)
    full["layers"] = [layer.clone() for layer in full["layers"]]  # the state's own are changed below
    future = ckptfmt.async_save(state, f"{repo}/step-7", step=7, timeout=60)
    model = state["model"]
    with torch.no_grad():
        for layer in model["layers"]:
            layer.add_(1.0)
        for key in ("row", "grid", "half"):
            model[key].to_local().add_(1.0)
    state["step"] = 8
    return {"url": future.result(timeout=120), "full": full}


def test_a_collective_async_save_keeps_the_state_at_the_call(tmp_path):
    results = [o.unwrap() for o in run_ranks(async_save_then_train, WORLD, tmp_path, repo=str(tmp_path / "repo"))]
    full = results[0]["full"]
    loaded = ckptfmt.load(results[0]["url"])
    assert loaded["step"] == 7
    for key in ("row", "grid", "half", "bias"):
        assert torch.equal(loaded["model"][key], full[key]), key
    for got, want in zip(loaded["model"]["layers"], full["layers"]):
        assert torch.equal(got, want)
    assert ckptfmt.verify(results[0]["url"]).ok


def dtensors_saved_alone(rank: int, world: int, folder: Path, repo: str) -> dict:
    """A DTensor saved by a process saving alone: the whole tensor on a mesh of one process (a job of
    one rank, such as torchtitan or FSDP2 on one GPU), only this rank's shard on a mesh of two."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(40.0).reshape(8, 5)
    state = {"dt": distribute_tensor(full, mesh, [Shard(0)]), "step": 3}
    try:
        url = ckptfmt.save(state, f"{repo}/solo-{rank}", coordinated=False)
    except ckptfmt.CheckpointError as exc:
        return {"error": str(exc)}
    staged = ckptfmt.async_save(state, f"{repo}/async-{rank}", coordinated=False).result(timeout=60)
    into = {"dt": distribute_tensor(torch.zeros(8, 5), mesh, [Shard(0)]), "step": 0}
    ckptfmt.load(staged, into=into)
    return {"url": url, "async": staged, "loaded": into["dt"].full_tensor(), "step": into["step"]}


@pytest.mark.parametrize("world", [1, 2])
def test_a_dtensor_is_saved_by_a_process_alone_only_where_it_is_the_whole_mesh(tmp_path, world):
    outcomes = [o.unwrap() for o in run_ranks(dtensors_saved_alone, world, tmp_path, repo=str(tmp_path / "repo"))]
    full = torch.arange(40.0).reshape(8, 5)
    if world == 2:
        assert all("DTensor is saved by a collective save" in outcome["error"] for outcome in outcomes)
        return
    (outcome,) = outcomes
    assert torch.equal(outcome["loaded"], full) and outcome["step"] == 3
    with ckptfmt.open(outcome["url"]) as reader:
        assert torch.equal(reader.get_tensor("dt"), full)
        assert reader.metadata["topology"]["meshes"] == [{"shape": [1], "dim_names": None}]
    assert torch.equal(ckptfmt.load(outcome["async"])["dt"], full)


# -- deltas -----------------------------------------------------------------------------------------
def save_two_steps(rank: int, world: int, folder: Path, repo: str, compression: str) -> list[str]:
    """Two steps of a run whose weights move a little: a row-sharded DTensor (each shard 512 KiB) and a
    replicated tensor, saved collectively; the second save may store deltas against the first."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    generator = torch.Generator().manual_seed(0)  # every rank builds the same full tensors
    full = {"sharded": torch.randn(world * 64, 2048, generator=generator),
            "replicated": torch.randn(256, 1024, generator=generator)}
    urls = []
    for step in range(2):
        state = {"sharded": distribute_tensor(full["sharded"], mesh, [Shard(0)]),
                 "replicated": full["replicated"].clone(), "step": step}
        urls.append(ckptfmt.save(state, f"{repo}/step-{step}", step=step, compression=compression,
                                 chunk_size=2**17, timeout=60))
        full = {key: value + 1e-3 * torch.randn(value.shape, generator=generator) for key, value in full.items()}
    return urls


def test_a_collective_save_stores_deltas_against_its_parent_and_loads_bit_exact(tmp_path):
    stored = {}
    for compression in ("delta-zstd", "shuffle-zstd"):
        repo = tmp_path / compression
        urls = [o.unwrap() for o in run_ranks(save_two_steps, 2, tmp_path / f"ranks-{compression}",
                                              repo=str(repo), compression=compression)][0]
        with ckptfmt.open(urls[1]) as reader:
            chunks = reader.manifest.chunks
            sharded = next(t for t in reader.manifest.tensors if t.key == "sharded")
        stored[compression] = ckptfmt.Repository.open(str(repo)).commit("step-1").totals["new_bytes"]
        assert ckptfmt.verify(str(repo)).ok
        if compression == "delta-zstd":
            assert len(sharded.shards) == 2
            assert all(chunks[p.chunk].base is not None for s in sharded.shards for p in s.pieces)
            assert any(c.base is not None for c in chunks if c not in
                       {chunks[p.chunk] for s in sharded.shards for p in s.pieces})  # the replicated one
            delta_loaded = ckptfmt.load(urls[1])
        else:
            whole_loaded = ckptfmt.load(urls[1])
    assert stored["delta-zstd"] < 0.8 * stored["shuffle-zstd"]
    for key in ("sharded", "replicated"):
        assert torch.equal(delta_loaded[key], whole_loaded[key])  # same values, bit for bit


def save_tied_weights(rank: int, world: int, folder: Path, repo: str) -> dict:
    """Tied weights (one tensor under two keys) in a collective save, with a hook run before the commit."""
    embedding = torch.arange(64.0).reshape(8, 8)
    calls = []

    def before_commit() -> None:  # records whether the checkpoint is committed yet
        calls.append(ckptfmt.Repository.open(repo).storage.exists(commit_key("tied")))
    url = ckptfmt.save({"embed": embedding, "head": embedding, "rank": ckptfmt.PerRank(rank)}, f"{repo}/tied",
                       timeout=60, before_commit=before_commit)
    return {"url": url, "calls": calls}


def test_tied_weights_stay_one_tensor_and_the_coordinator_runs_before_commit(tmp_path):
    results = [o.unwrap() for o in run_ranks(save_tied_weights, 2, tmp_path / "ranks", repo=str(tmp_path / "repo"))]
    assert [r["calls"] for r in results] == [[False], []]  # once, on the coordinator, before the commit
    loaded = ckptfmt.load(results[0]["url"])
    assert loaded["embed"] is loaded["head"] and torch.equal(loaded["head"], torch.arange(64.0).reshape(8, 8))
    with ckptfmt.open(results[0]["url"]) as reader:
        embed, head = reader.manifest.tensors
    assert head.same_as == 0 and head.shards == embed.shards  # spec 6.9: the named entry's shards
    assert ckptfmt.verify(results[0]["url"]).ok


# -- over a subgroup ------------------------------------------------------------------------------
def signed_save(rank: int, world: int, folder: Path, repo: str, key: str) -> str:
    """A collective save signed by the coordinator: only rank 0 has the private key."""
    return ckptfmt.save({"w": torch.arange(8.0), "rank": ckptfmt.PerRank(rank)}, f"{repo}/signed",
                        signer=key if rank == 0 else None)


def test_a_collective_save_is_signed_by_its_coordinator(tmp_path):
    from ckptfmt.lifecycle.signing import generate_key

    key, public, _ = generate_key(tmp_path / "key")
    outcomes = [o.unwrap() for o in run_ranks(signed_save, WORLD, tmp_path / "ranks", repo=str(tmp_path / "repo"),
                                              key=key)]
    assert len(set(outcomes)) == 1
    assert ckptfmt.verify(outcomes[0], trusted_keys=public).ok
    assert ckptfmt.load(outcomes[0], trusted_keys=public)["rank"] == {r: r for r in range(WORLD)}


def save_in_pairs(rank: int, world: int, folder: Path, repo: str) -> str:
    """Ranks {0, 1} and {2, 3} each save their own checkpoint into one repository, at the same time,
    over their own subgroup (pair 1 asynchronously); the pairs never wait for each other."""
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = rank // 2
    state = {"w": torch.full((64, 256), float(pair)), "mine": ckptfmt.PerRank(rank), "pair": pair}
    url = f"{repo}/pair-{pair}"
    if pair == 0:
        return ckptfmt.save(state, url, process_group=pairs[pair], timeout=60)
    return ckptfmt.async_save(state, url, process_group=pairs[pair], timeout=60).result(timeout=120)


def test_a_save_over_a_subgroup_involves_only_its_ranks(tmp_path):
    repo = tmp_path / "repo"
    outcomes = [o.unwrap() for o in run_ranks(save_in_pairs, WORLD, tmp_path / "ranks", repo=str(repo))]
    assert outcomes[0] == outcomes[1] != outcomes[2] == outcomes[3]
    for pair in (0, 1):
        url = str(repo / f"pair-{pair}")
        with ckptfmt.open(url) as reader:
            topology = reader.metadata["topology"]
        assert topology["world_size"] == 2
        assert [r["rank"] for r in topology["ranks"]] == [0, 1]  # the group's ranks, as in shard fields
        assert [r["global_rank"] for r in topology["ranks"]] == [2 * pair, 2 * pair + 1]
        loaded = ckptfmt.load(url)
        assert loaded["pair"] == pair and torch.equal(loaded["w"], torch.full((64, 256), float(pair)))
        assert loaded["mine"] == {0: 2 * pair, 1: 2 * pair + 1}  # by group rank
    assert ckptfmt.verify(str(repo)).ok


# -- failures --------------------------------------------------------------------------------
def fail_on_one_rank(rank: int, world: int, folder: Path, repo: str, where: str) -> str:
    """Save a base checkpoint together, then a second one in which one rank fails."""
    ckptfmt.save({"w": torch.ones(1000) * rank, "n": 1}, f"{repo}/base", timeout=60)
    state = {"w": torch.ones(1000) * rank, "n": 2}
    if where == "plan" and rank == 1:
        state["bad"] = object()  # refused while encoding this rank's state
    if where == "write" and rank == 2:
        def store_fails(*args, **kwargs):
            raise OSError(28, "No space left on device")
        pipeline.store_sources = store_fails
    ckptfmt.save(state, f"{repo}/next", timeout=60)
    return "committed"


def side_groups_after_a_failed_save(rank: int, world: int, folder: Path, repo: str) -> int:
    """The side groups still alive once released as at exit, after a save that raised on every rank."""
    from ckptfmt.groups import process_group

    with pytest.raises(ckptfmt.CollectiveError):
        fail_on_one_rank(rank, world, folder, repo, "plan")
    process_group.release_side_groups()
    return len(list(process_group._MADE))


def test_side_groups_are_freed_before_the_interpreter_shuts_down(tmp_path):
    """A failed save leaves its side group in an exception's reference cycle; a group whose gloo threads
    outlived the interpreter's shutdown aborted ranks at exit ("terminate called without an active
    exception", in ~AsyncBroadcastWork taking the GIL during Py_FinalizeEx)."""
    outcomes = run_ranks(side_groups_after_a_failed_save, WORLD, tmp_path, repo=str(tmp_path / "repo"))
    assert [o.unwrap() for o in outcomes] == [0] * WORLD


@pytest.mark.parametrize(("where", "failing", "message"), [
    ("plan", 1, "state['bad']: cannot store a builtins.object"),
    ("write", 2, "No space left on device"),
])
def test_a_failing_rank_fails_every_rank_and_commits_nothing(tmp_path, where, failing, message):
    repo = tmp_path / "repo"
    outcomes = run_ranks(fail_on_one_rank, WORLD, tmp_path, repo=str(repo), where=where)
    for rank, outcome in enumerate(outcomes):
        assert outcome.error_type == "CollectiveError", (rank, outcome)
        assert f"rank {failing}: " in outcome.error and message in outcome.error, outcome.error
        assert "nothing was committed" in outcome.error
    assert ckptfmt.Repository.open(repo).names() == ["base"]
    assert ckptfmt.verify(str(repo)).ok


def save_on_rank_zero_only(rank: int, world: int, folder: Path, repo: str) -> dict:
    """The old habit: only rank 0 saves. It must fail clearly, and coordinated=False must work."""
    if rank != 0:
        return {}
    start = time.monotonic()
    try:
        ckptfmt.save({"w": torch.ones(3)}, f"{repo}/a", timeout=3)
    except ckptfmt.CollectiveError as exc:
        error = str(exc)
    waited = time.monotonic() - start
    url = ckptfmt.save({"w": torch.ones(3)}, f"{repo}/a", coordinated=False)
    return {"error": error, "waited": waited, "url": url}


def test_a_save_called_on_rank_zero_only_says_what_to_do(tmp_path):
    outcomes = run_ranks(save_on_rank_zero_only, WORLD, tmp_path, repo=str(tmp_path / "repo"))
    result = outcomes[0].unwrap()
    assert "coordinated=False" in result["error"] and "every rank" in result["error"].lower()
    assert result["waited"] < 60  # its timeout is 3 s; ignoring it would take the default 600 s (or hang)
    assert torch.equal(ckptfmt.load(result["url"])["w"], torch.ones(3))
    assert ckptfmt.open(result["url"]).metadata["topology"]["world_size"] == WORLD


# -- per-rank values in one process ------------------------------------------------------------
def test_a_per_rank_value_saved_by_one_process_loads_as_its_rank(tmp_path):
    url = ckptfmt.save({"loader": ckptfmt.PerRank({"position": 3}), "step": 1}, tmp_path / "repo" / "a")
    state = ckptfmt.load(url)
    assert state == {"loader": ckptfmt.PerRankValues({0: {"position": 3}}), "step": 1}
    assert type(state["loader"]) is ckptfmt.PerRankValues


def test_tensors_inside_a_per_rank_value_are_refused_with_their_path(tmp_path):
    with pytest.raises(ckptfmt.UnsupportedValueError, match=r"state\['rng'\]\[0\]: tensors inside ckptfmt.PerRank"):
        ckptfmt.save({"rng": ckptfmt.PerRank([torch.get_rng_state()])}, tmp_path / "repo" / "a")


def test_a_per_rank_value_keyed_by_something_else_than_a_rank_is_refused(tmp_path):
    import msgpack

    from ckptfmt.format.values import EXT_PER_RANK, decode_tree

    data = msgpack.packb(msgpack.ExtType(EXT_PER_RANK, msgpack.packb({"zero": 1})))
    with pytest.raises(ckptfmt.ManifestError, match="per-rank value keyed by something other than a rank"):
        decode_tree(data)
