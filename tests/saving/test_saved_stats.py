"""Tensor statistics in saved checkpoints (spec 6.10): taken while the bytes are hashed, by every way
of saving, equal to numpy's figures on the tensors loaded back; reused for bytes that did not
change; refused when a manifest lies about them; shown by ``show`` and checked by ``verify --stats``."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.cli import main
from ckptfmt.errors import ManifestError
from ckptfmt.saving import pipeline
from ckptfmt.saving.hashcache import HashCache
from ckptfmt.storage.factory import open_storage
from ckptfmt.tensors import stats as stats_module
from tests.support.helpers import rewrite_manifest
from tests.support.tensor_values import FLOAT_DTYPES, INTEGER_DTYPES, assert_stats_close, expected_stats, special


def special_state(seed: int = 0) -> dict:
    """Every float dtype, small (packed) and large (cut into several chunks at chunk_size=64 KiB), with
    zeros, NaN and infinities; integers and bools; a numpy array; a tied tensor; an empty tensor."""
    generator = torch.Generator().manual_seed(seed)
    state: dict = {}
    for dtype in FLOAT_DTYPES:
        name = str(dtype).removeprefix("torch.")
        state[f"small_{name}"] = special(dtype, generator, 1000)
        state[f"large_{name}"] = special(dtype, generator, 150_000).reshape(300, 500)
    for dtype in INTEGER_DTYPES:
        state[str(dtype).removeprefix("torch.")] = (torch.randint(0, 2, (99_000,), generator=generator) > 0
                                                    if dtype == torch.bool else
                                                    torch.randint(-100, 100, (99_000,), generator=generator)
                                                    .clamp(min=0 if dtype == torch.uint8 else -100).to(dtype))
    state["numpy"] = np.linspace(-1, 1, 70_001, dtype=np.float32)
    state["tied"] = state["large_float32"]
    state["empty"] = torch.empty(0, 3)
    state["scalar"] = torch.tensor(-2.5)
    return state


def assert_recorded_stats_match(url: str) -> None:
    """Every tensor's recorded statistics are numpy's on the tensor loaded back."""
    loaded = ckptfmt.load(url)
    with ckptfmt.open(url) as reader:
        for key in reader.keys():
            value = loaded
            for part in key.split("/"):
                value = value[part]
            tensor = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
            assert_stats_close(expected_stats(tensor), reader.tensor_stats(key), key)


@pytest.mark.parametrize("how", ["save", "zstd", "async"])
def test_every_dtype_and_layout_records_the_statistics_of_what_loads_back(tmp_path, how):
    state = special_state()
    url = str(tmp_path / "repo" / "a")
    if how == "async":
        ckptfmt.async_save(state, url, chunk_size=2**16).result()
    else:
        ckptfmt.save(state, url, chunk_size=2**16, compression="shuffle-zstd" if how == "zstd" else None)
    with ckptfmt.open(url) as reader:
        assert len(reader.tensor_info("large_float32").shards[0].pieces) > 1  # cut into several chunks
        entry = reader.manifest.tensors[[t.key for t in reader.manifest.tensors].index("tied")]
        assert entry.same_as is not None and entry.stats is None  # the named entry holds them
    assert_recorded_stats_match(url)


def test_a_packs_small_tensors_are_measured_together_each_as_alone(tmp_path):
    """Small tensors packed into one chunk are reduced together (segmented reductions): each one's figures
    are still its own, the sign of a zero extreme included (the first two elements are +0.0 and -0.0);
    a tensor holding a NaN or an infinity (those of more than 7 elements here) is measured alone."""
    generator = torch.Generator().manual_seed(3)
    state = {}
    for dtype in FLOAT_DTYPES:
        for index in range(24):
            state[f"{str(dtype).removeprefix('torch.')}_{index}"] = special(dtype, generator, 1 + index % 12)
    for dtype in INTEGER_DTYPES:
        for index in range(24):
            values = torch.randint(-100, 100, (1 + index % 12,), generator=generator)
            state[f"{str(dtype).removeprefix('torch.')}_{index}"] = (
                values > 0 if dtype == torch.bool else values.clamp(min=0 if dtype == torch.uint8 else -100).to(dtype))
    url = str(tmp_path / "repo" / "a")
    ckptfmt.save(state, url)
    with ckptfmt.open(url) as reader:
        assert len(reader.manifest.chunks) == 1  # one pack
    assert_recorded_stats_match(url)


def test_a_packs_tensors_of_dtypes_in_turn_are_measured_each_as_alone(tmp_path):
    """Tensors of four dtypes in turn fill packs (a dtype's spans of a pack are reduced together, the
    others' bytes between them dropped) over several runs of a pack: each one's figures are its own."""
    from ckptfmt.saving.chunk_writer import STATS_RUN_BYTES

    generator = torch.Generator().manual_seed(11)
    dtypes = (torch.float32, torch.int64, torch.float16, torch.bool)
    state = {}
    for index in range(5000):
        dtype, length = dtypes[index % 4], 1 + index % 301
        state[f"t{index}"] = (special(dtype, generator, length) if dtype.is_floating_point else
                              torch.randint(-100, 100, (length,), generator=generator) > 0 if dtype == torch.bool else
                              torch.randint(-100, 100, (length,), generator=generator).to(dtype))
    url = str(tmp_path / "repo" / "a")
    ckptfmt.save(state, url)
    with ckptfmt.open(url) as reader:
        assert max(chunk.size for chunk in reader.manifest.chunks) > 4 * STATS_RUN_BYTES  # several runs a pack
    assert_recorded_stats_match(url)


def test_shards_are_measured_one_by_one_and_merged_exactly(tmp_path):
    tensor = special(torch.float32, torch.Generator().manual_seed(5), 80_000).reshape(400, 200)
    sharded = ckptfmt.Sharded((400, 200), [ckptfmt.Shard((0, 0), tensor[:130].clone(), 0),
                                           ckptfmt.Shard((130, 0), tensor[130:].clone(), 1)])
    url = str(tmp_path / "repo" / "a")
    ckptfmt.save({"w": sharded}, url, chunk_size=2**16)
    with ckptfmt.open(url) as reader:
        assert len(reader.tensor_info("w").shards) == 2
        assert_stats_close(expected_stats(tensor), reader.tensor_stats("w"))


def test_chunks_hold_whole_elements_whatever_the_chunk_size(tmp_path):
    """A chunk size that is no multiple of the element size is rounded down per tensor, so that every
    chunk's statistics are those of whole elements."""
    tensor = torch.randn(40_000, dtype=torch.float64)  # 320 KB: above the packing threshold
    url = str(tmp_path / "repo" / "a")
    ckptfmt.save({"w": tensor}, url, chunk_size=4099)
    with ckptfmt.open(url) as reader:
        lengths = [p.length for p in reader.tensor_info("w").shards[0].pieces]
        assert len(lengths) > 1 and all(length % 8 == 0 for length in lengths)
        assert_stats_close(expected_stats(tensor), reader.tensor_stats("w"))


def count_block_passes(monkeypatch) -> list[int]:
    """Counts the elements the statistics look at (every ``StatsAccumulator.add``)."""
    seen = [0]
    original = stats_module.StatsAccumulator.add

    def counting(self, values):
        seen[0] += values.numel()
        return original(self, values)
    monkeypatch.setattr(stats_module.StatsAccumulator, "add", counting)
    return seen


def test_unchanged_bytes_reuse_their_statistics_and_changed_ones_are_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "DEFAULT_CACHE", HashCache())
    state = {"a": torch.randn(200_000), "b": torch.randn(300_000)}
    repo = tmp_path / "repo"
    ckptfmt.save(state, f"{repo}/one")
    seen = count_block_passes(monkeypatch)
    state["b"].mul_(2)
    ckptfmt.save(state, f"{repo}/two")
    assert seen[0] == 300_000  # only the changed tensor was measured
    assert_recorded_stats_match(f"{repo}/two")
    with ckptfmt.open(f"{repo}/one") as one, ckptfmt.open(f"{repo}/two") as two:
        assert one.tensor_stats("a") == two.tensor_stats("a")
        assert two.tensor_stats("b")["l2"] == pytest.approx(2 * one.tensor_stats("b")["l2"], rel=1e-12)


def test_a_new_process_measures_bytes_it_finds_in_the_parent(tmp_path, monkeypatch):
    """After a restart the fingerprint cache is empty: unchanged bytes are hashed to find them in the
    parent, and measured in that pass."""
    state = {"a": torch.randn(200_000)}
    repo = tmp_path / "repo"
    ckptfmt.save(state, f"{repo}/one")
    monkeypatch.setattr(pipeline, "DEFAULT_CACHE", HashCache())  # what a new process starts with
    ckptfmt.save(state, f"{repo}/two")
    with ckptfmt.open(f"{repo}/two") as reader:
        assert reader.manifest.totals["new_bytes"] == 0  # found in the parent, not written again
    assert_recorded_stats_match(f"{repo}/two")


def test_statistics_can_be_left_out(tmp_path, capsys):
    url = str(tmp_path / "repo" / "a")
    ckptfmt.save({"w": torch.ones(3)}, url, tensor_stats=False)
    with ckptfmt.open(url) as reader:
        assert reader.tensor_stats("w") is None
    assert main(["show", "--json", url]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"][0]["stats"] is None
    with pytest.raises(TypeError, match="tensor_stats"):
        ckptfmt.save({"w": torch.ones(3)}, str(tmp_path / "repo" / "b"), tensor_stats="yes")


def test_statistics_cost_at_most_200_bytes_of_manifest_per_tensor(tmp_path):
    state = {f"layer{i}": torch.randn(64) for i in range(500)}
    sizes = {}
    for with_stats in (True, False):
        url = str(tmp_path / f"repo-{with_stats}" / "a")
        ckptfmt.save(state, url, tensor_stats=with_stats)
        with ckptfmt.open(url) as reader:
            sizes[with_stats] = len(reader.manifest.to_bytes())
    assert 0 < (sizes[True] - sizes[False]) / len(state) <= 200


# -- a manifest that lies ---------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(count=5), "stats count 5 differs from the 4 elements"),
    (lambda s: s.update(nan=-1), "stats nan must be an integer in"),
    (lambda s: s.update(zeros=9), "stats zeros must be an integer in"),
    (lambda s: s.update(mean="big"), "stats mean must be a number or nil"),
    (lambda s: s.update(l2=True), "stats l2 must be a number or nil"),
    (lambda s: s.pop("posinf"), "stats fields .* are none of the sets spec 6.10 defines"),
    (lambda s: s.clear(), "stats fields .* are none of the sets spec 6.10 defines"),
], ids=["count", "negative", "over-count", "string", "bool", "missing-field", "empty"])
def test_a_manifest_with_bad_statistics_is_refused_naming_the_tensor(tmp_path, change, message):
    url = str(tmp_path / "repo" / "a")
    ckptfmt.save({"w": torch.tensor([1.0, 2.0, 0.0, 4.0])}, url)
    storage = open_storage(str(tmp_path / "repo"))
    rewrite_manifest(storage, "a", lambda doc: change(doc["tensors"][0]["stats"]))
    with pytest.raises(ManifestError, match=f"tensor 'w': {message}"):
        ckptfmt.open(url)


@pytest.mark.parametrize("value", [None, [1, 2], "x"], ids=["nil", "array", "string"])
def test_statistics_that_are_no_map_are_refused(tmp_path, value):
    url = str(tmp_path / "repo" / "a")
    ckptfmt.save({"w": torch.ones(2)}, url)
    rewrite_manifest(open_storage(str(tmp_path / "repo")), "a", lambda doc: doc["tensors"][0].update(stats=value))
    with pytest.raises(ManifestError, match="tensor 'w'"):
        ckptfmt.open(url)


def test_a_newer_writers_extra_statistics_are_kept_and_older_manifests_have_none(tmp_path):
    url = str(tmp_path / "repo" / "a")
    ckptfmt.save({"w": torch.ones(2)}, url)
    storage = open_storage(str(tmp_path / "repo"))
    rewrite_manifest(storage, "a", lambda doc: doc["tensors"][0]["stats"].update(p99=1.0))
    with ckptfmt.open(url) as reader:
        assert reader.tensor_stats("w")["p99"] == 1.0
    rewrite_manifest(storage, "a", lambda doc: (doc["tensors"][0].pop("stats"), doc.update(version=[1, 3])))
    with ckptfmt.open(url) as reader:
        assert reader.tensor_stats("w") is None
    assert ckptfmt.verify(url, stats=True).ok


# -- verify --stats ---------------------------------------------------------------------------

def test_verify_recomputes_the_statistics_and_names_a_tensor_whose_record_lies(tmp_path, capsys):
    repo = tmp_path / "repo"
    ckptfmt.save(special_state(), f"{repo}/a", chunk_size=2**16)
    report = ckptfmt.verify(f"{repo}/a", stats=True)
    assert report.ok and report.stats_checked == len(special_state()) - 1  # the tied entry has none

    def lie(doc):
        for tensor in doc["tensors"]:
            if tensor["key"] == "large_bfloat16":
                tensor["stats"]["nan"] += 1
            if tensor["key"] == "small_float32":
                tensor["stats"]["mean"] += 1e-3
    rewrite_manifest(open_storage(str(repo)), "a", lie)
    assert ckptfmt.verify(f"{repo}/a").ok  # the bytes are intact: only the statistics lie
    report = ckptfmt.verify(f"{repo}/a", stats=True)
    assert sorted((p.kind, p.tensors) for p in report.problems) == [
        ("wrong-stats", ("large_bfloat16",)), ("wrong-stats", ("small_float32",))]
    by_tensor = {p.tensors[0]: p.message for p in report.problems}
    assert "nan recorded" in by_tensor["large_bfloat16"] and "mean recorded" in by_tensor["small_float32"]
    assert main(["verify", "--stats", f"{repo}/a"]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "wrong-stats" in out and "large_bfloat16" in out


def test_verify_streams_tensors_whose_pieces_split_an_element(tmp_path):
    """Another writer may cut a shard's bytes anywhere: [0, 6) and [6, 16) of a 16-byte chunk split the
    second float32. Its statistics are still recomputed, carrying the partial element across."""
    repo = tmp_path / "repo"
    ckptfmt.save({"w": torch.tensor([1.0, -2.0, 0.0, 4.0])}, f"{repo}/a")
    ckptfmt.verify(f"{repo}/a", stats=True)

    def split(doc):
        (chunk, offset, length), = doc["tensors"][0]["shards"][0]["pieces"]
        doc["tensors"][0]["shards"][0]["pieces"] = [[chunk, offset, 6], [chunk, offset + 6, length - 6]]
    storage = open_storage(str(repo))
    rewrite_manifest(storage, "a", split)
    assert torch.equal(ckptfmt.load(f"{repo}/a")["w"], torch.tensor([1.0, -2.0, 0.0, 4.0]))
    assert ckptfmt.verify(f"{repo}/a", stats=True).ok
    rewrite_manifest(storage, "a", lambda doc: doc["tensors"][0]["stats"].update(min=-3.0))
    (problem,) = ckptfmt.verify(f"{repo}/a", stats=True).problems
    assert problem.kind == "wrong-stats" and "min recorded -3.0, bytes give -2.0" in problem.message


# -- show ---------------------------------------------------------------------------------------

def test_show_prints_the_statistics_and_its_json_holds_them_all(tmp_path, capsys):
    url = str(tmp_path / "repo" / "a")
    state = {"w": torch.tensor([3.0, -4.0, 0.0, float("nan"), float("inf")]), "i": torch.tensor([0, 7, -9])}
    ckptfmt.save(state, url)
    assert main(["show", "--json", url]) == 0
    tensors = {t["key"]: t for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert tensors["w"]["stats"] == {"count": 5, "min": -4.0, "max": 3.0, "mean": -1 / 3, "l2": 5.0,
                                     "absmax": 4.0, "nan": 1, "posinf": 1, "neginf": 0, "zeros": 1}
    assert tensors["i"]["stats"] == {"count": 3, "min": -9, "max": 7, "zeros": 1}
    assert main(["show", url]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line[:2] in ("w ", "i ")}
    assert " ".join(rows["w"]).endswith("20 B -0.3333 5 4 1 nan, 1 +inf 20%")
    assert " ".join(rows["i"]).endswith("24 B - - 9 - 33.3%")


def test_statistics_taken_on_the_device_while_staging_are_stored_without_a_host_pass(tmp_path, monkeypatch):
    """An asynchronous save of CUDA tensors reduces their statistics on the device as it stages them
    (staging.StagingArea); the save stores those and measures nothing again on the host. Driven here
    with the staged buffer's statistics handed over as the staging area hands them."""
    from ckptfmt.saving.options import SaveOptions
    from ckptfmt.saving.records import Captured
    from ckptfmt.saving.save import run_save
    from ckptfmt.saving.staging import memory_key

    staged = {"on_device": torch.randn(300_000), "on_host": torch.randn(300_000)}
    taken = tensor_stats_of(staged["on_device"])
    seen = count_block_passes(monkeypatch)
    url = str(tmp_path / "repo" / "a")
    run_save(staged, url, SaveOptions(), Captured(frozen=True,
                                                  device_stats={memory_key(staged["on_device"]): taken}))
    assert seen[0] == 300_000  # the host measured the other tensor only
    with ckptfmt.open(url) as reader:
        assert reader.tensor_stats("on_device") == taken
    assert_recorded_stats_match(url)


def tensor_stats_of(tensor: torch.Tensor) -> dict:
    from ckptfmt.tensors.stats import PendingStats

    return PendingStats(tensor).result()


def test_show_fits_the_statistics_in_100_columns_with_the_keys_on_lines_of_their_own(tmp_path, capsys,
                                                                                   monkeypatch):
    """In a 100-column terminal every statistics column stays in the table (a key too long for its row
    moves to a line of its own; where the other columns leave the keys too little room, every key does)
    and no line is longer. Which of the two depends on how wide the figures print: both are checked."""
    for name in ("FORCE_COLOR", "NO_COLOR", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    key = "encoder.layers.11.self_attention.query_key_value.lora_A.default.weight"
    layouts = set()
    for seed in (0, 12):  # seed 12's mean prints a digit wider: the keys' column no longer fits beside the rest
        weight = torch.randn(1024, 1000, generator=torch.Generator().manual_seed(seed))
        state = {key: weight, "bias": torch.full((30000,), -1.5e-5, dtype=torch.bfloat16)}
        state["bias"][::7] = float("nan")
        ckptfmt.save(state, str(tmp_path / "repo" / f"s{seed}"))
        assert main(["show", str(tmp_path / "repo" / f"s{seed}")]) == 0
        lines = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line) for line in capsys.readouterr().out.splitlines()]
        assert max(map(len, lines)) <= 100
        at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("key"))
        stacked = lines[at].split() == ["key"]  # every key on a line of its own, the figures under it
        layouts.add(stacked)
        header = lines[at].split() + (lines[at + 1].split() if stacked else [])
        assert header == ["key", "dtype", "shape", "size", "mean", "l2", "absmax", "nan/inf", "zeros"]
        assert key in lines  # on a line of its own, whole
        at = lines.index("bias") + 1 if stacked else next(i for i, line in enumerate(lines) if line.startswith("bias"))
        assert "4286 nan" in lines[at] and "(30000)" in lines[at]
    assert layouts == {False, True}
