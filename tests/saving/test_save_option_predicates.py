"""SaveOptions' parts and predicates (``encoding``, ``group``, ``node_scoped``, ``records_own_rng``): each
choice an option implies is decided in one place, and what a save does follows that decision. Each test
saves (or runs the part that reads the predicate) and checks what was done against what the predicate
said, over every value the option takes."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.errors import CollectiveError
from ckptfmt.format import codecs
from ckptfmt.format.features import first_version, parse_version
from ckptfmt.format.version import FORMAT_VERSION
from ckptfmt.groups.ranks import SoloRanks
from ckptfmt.metadata.step_timer import StepTimer
from ckptfmt.saving import save as save_module
from ckptfmt.saving.options import DIVERGENCE_POLICIES, SaveOptions
from tests.support.ranks import run_ranks

#: Format versions around the codecs' (delta chunks 1.5, float codecs 1.11): before both, between, this one.
VERSIONS = ["1.4", "1.10", None]


def _options(compression: str | None, version: str | None) -> SaveOptions | None:
    """The options, or None where the version cannot express the compression (refused by name)."""
    try:
        return SaveOptions(compression=compression, format_version=version)
    except ValueError as exc:
        assert f"compression={compression!r}" in str(exc)
        return None


def _chunks(url: str, key: str) -> list:
    with ckptfmt.open(url) as reader:
        chunks = reader.manifest.chunks
        (tensor,) = [tensor for tensor in reader.manifest.tensors if tensor.key == key]
        rows = {piece.chunk for shard in tensor.shards for piece in shard.pieces}
    return [chunks[row] for row in sorted(rows)]


@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: f"format-{v or 'own'}")
@pytest.mark.parametrize("compression", codecs.COMPRESSIONS, ids=str)
def test_the_encoding_decides_what_the_chunk_writer_does(tmp_path, compression, version):
    """Over every compression and format: a tensor's chunks are stored against the parent's exactly where
    ``stores_deltas``, raw bytes kept uncompressed where ``weighs_codecs`` (or no compression), and
    floating-point chunks stored with the float codecs exactly where ``float_coded``."""
    options = _options(compression, version)
    if options is None:
        needed = first_version("float-codecs" if compression == "float-zstd" else "delta-codecs")
        assert version is not None and parse_version(version) < needed
        return
    encoding = options.encoding
    assert encoding.compression == compression
    assert encoding.float_codecs == (options.format_version >= (1, 11))
    assert encoding.delta_codecs == (options.format_version >= (1, 5))
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(2**17, generator=generator) * 0.02  # 512 KiB: stored alone, never packed
    noise = torch.randint(0, 256, (2**19,), generator=generator, dtype=torch.uint8)  # incompressible
    repo = tmp_path / "repo"
    keywords = {"compression": compression, "format_version": version}
    ckptfmt.save({"w": weights, "noise": noise}, f"{repo}/a", **keywords)
    later = weights.clone()
    later[::1000] += 1.0  # a training step's few changes: a delta of mostly zeros
    ckptfmt.save({"w": later, "noise": noise}, f"{repo}/b", **keywords)

    (first,) = _chunks(f"{repo}/a", "w")
    (second,) = _chunks(f"{repo}/b", "w")
    assert (second.base is not None) == encoding.stores_deltas
    assert encoding.stores_deltas <= encoding.chooses_per_chunk
    assert options.format_version >= first_version("delta-codecs") or not encoding.stores_deltas
    assert options.format_version >= first_version("float-codecs") or not encoding.float_coded
    assert first.codec.startswith("float") == encoding.float_coded
    raw = {chunk.codec for chunk in _chunks(f"{repo}/a", "noise")} == {codecs.NONE}
    assert raw == (encoding.weighs_codecs or compression in (None, codecs.NONE))
    assert torch.equal(ckptfmt.load(f"{repo}/b")["w"], later)


def test_small_float_tensors_are_packed_by_dtype_exactly_where_they_are_float_coded(tmp_path):
    """A pack of one float dtype is stored as that dtype's tensors are (spec 5.2): only where the float
    codecs store them; elsewhere small tensors share the mixed pack."""
    state = {"a": torch.randn(64), "b": torch.arange(64), "c": torch.randn(64)}
    for compression in codecs.COMPRESSIONS:
        for version in VERSIONS:
            options = _options(compression, version)
            if options is None:
                continue
            url = f"{tmp_path}/repo-{compression}-{version}/x"
            ckptfmt.save(state, url, compression=compression, format_version=version)
            rows = {key: {piece.chunk for piece in tensor.shards[0].pieces}
                    for key, tensor in _tensors(url).items()}
            apart = rows["a"] == rows["c"] and rows["a"] != rows["b"]
            assert apart == options.encoding.float_coded, (compression, version)


def _tensors(url: str) -> dict:
    with ckptfmt.open(url) as reader:
        return {tensor.key: tensor for tensor in reader.manifest.tensors}


def test_encoding_takes_the_defaults_where_none_is_given():
    encoding = SaveOptions().encoding
    assert encoding.chunk_size == 64 * 2**20 and encoding.workers == 4 and encoding.tensor_stats
    assert SaveOptions(chunk_size=4096, workers=2, tensor_stats=False).encoding == type(encoding)(
        chunk_size=4096, workers=2, tensor_stats=False)
    assert SaveOptions().replace(compression="auto").encoding.weighs_codecs  # a replaced copy decides anew


@pytest.mark.parametrize("scope", ["job", "node"])
def test_node_scoped_decides_the_placement_and_the_marker(tmp_path, scope):
    options = SaveOptions(scope=scope)
    url = f"{tmp_path}/repo/a"
    ckptfmt.save({"w": torch.ones(8)}, url, scope=scope)
    with ckptfmt.open(url) as reader:
        placed = reader.manifest.placement is not None
    assert placed == options.node_scoped
    assert ("node-placement" in options.marker_features) == options.node_scoped
    if options.node_scoped:
        with pytest.raises(ValueError, match="node-scoped repository"):
            SaveOptions(scope=scope, compression="auto")


@pytest.mark.parametrize("given", [False, True])
def test_records_own_rng_decides_whose_rng_states_the_manifest_holds(tmp_path, given):
    ckptfmt.save({"w": torch.ones(2)}, f"{tmp_path}/first/a")
    with ckptfmt.open(f"{tmp_path}/first/a") as reader:
        own = reader.manifest.rng
    imported = [{**own[0], "rank": 0}]
    options = SaveOptions(rng=imported if given else None)
    torch.manual_seed(1234)  # this process's states now differ from the first save's
    ckptfmt.save({"w": torch.ones(2)}, f"{tmp_path}/repo/a", rng=options.rng)
    with ckptfmt.open(f"{tmp_path}/repo/a") as reader:
        stored = reader.manifest.rng
    assert (stored == imported) == (not options.records_own_rng)
    assert ("rng-words" in options.marker_features) == options.records_own_rng


@pytest.mark.parametrize("coordinated", [None, False, True])
def test_the_group_decides_who_saves(monkeypatch, coordinated):
    """``alone`` never asks torch.distributed for a group; ``needs_group`` refuses to save without one;
    else the group found (here: a fake one) is saved over."""
    group = SaveOptions(coordinated=coordinated, timeout=5).group
    asked, made = [], []
    for found in (None, "a process group"):
        monkeypatch.setattr(save_module, "distributed_group", lambda given, found=found: asked.append(given) or found)
        monkeypatch.setattr(save_module, "RankGroup", lambda *args: made.append(args) or "ranks")
        if found is None and group.needs_group:
            with pytest.raises(ValueError, match="coordinated=True needs"):
                save_module.saving_ranks("repo/a", group)
            continue
        ranks = save_module.saving_ranks("repo/a", group)
        assert isinstance(ranks, SoloRanks) == (group.alone or found is None)
    assert (asked == []) == group.alone
    assert made == ([] if group.alone else [("a process group", 5, "collective save of repo/a")])


def test_the_group_gives_each_rank_its_gathered_steps():
    timers = [StepTimer() for _ in range(3)]
    for rank, timer in enumerate(timers):
        for step in range(rank + 1):
            with timer.step(step):
                pass
    gathered = [{"rank": rank, "host": "h", "steps": timer.snapshot()} for rank, timer in enumerate(timers)]
    group = SaveOptions(gathered_steps=gathered).group
    for rank in range(3):
        assert group.steps_of(rank) is gathered[rank]
        assert [entry["rank"] for entry in group.steps_besides(rank)] == [r for r in range(3) if r != rank]
    assert group.steps_of(3) is None and SaveOptions().group.steps_of(0) is None
    assert SaveOptions().group.steps_besides(0) == []


# -- on_divergence, on two gloo ranks ---------------------------------------------------------
def _divergent_saves(rank: int, world: int, folder: Path, repo: str) -> dict:
    """One save per policy of a tensor both ranks hold, whose copies differ by one element on rank 1."""
    outcomes = {}
    for policy in DIVERGENCE_POLICIES:
        state = {"w": torch.zeros(256)}
        if rank == 1:
            state["w"][0] = 1.0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ckptfmt.save(state, f"{repo}/{policy}", timeout=60, on_divergence=policy)
                outcomes[policy] = {"warned": any("differ" in str(w.message) for w in caught)}
            except CollectiveError as exc:
                outcomes[policy] = {"error": str(exc)}
    return outcomes


@pytest.mark.distributed
def test_the_group_decides_whether_replicas_are_compared_and_whether_divergence_fails(tmp_path):
    repo = str(tmp_path / "repo")
    outcomes = [o.unwrap() for o in run_ranks(_divergent_saves, 2, tmp_path / "run", repo=repo)]
    for policy in DIVERGENCE_POLICIES:
        group = SaveOptions(on_divergence=policy).group
        failed = ["error" in outcome[policy] for outcome in outcomes]
        assert failed == [group.refuses_divergence] * 2, policy
        if group.refuses_divergence:
            with pytest.raises(ckptfmt.CheckpointNotFoundError):
                ckptfmt.open(f"{repo}/{policy}")
            continue
        with ckptfmt.open(f"{repo}/{policy}") as reader:
            recorded = reader.manifest.replicas
        assert (recorded is not None and len(recorded["divergent"]) == 1) == group.compares_replicas, policy
        assert outcomes[0][policy]["warned"] == group.compares_replicas, policy


def test_the_format_version_is_this_ckptfmts_unless_given():
    assert SaveOptions().format_version == FORMAT_VERSION
