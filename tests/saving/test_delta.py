"""Delta encoding (compression="delta-zstd" and "auto", spec 5.5): chunks stored as their XOR against the
parent's chunk for the same region round-trip bit-exact on every dtype, across chains, retention and gc,
replication to S3 and repair; a missing base is an error naming both chunks; chains stay bounded; a
hostile chunk table (a base out of range, a cycle, a base of another size) is refused."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest
import torch

import ckptfmt
from ckptfmt.cli import main
from ckptfmt.errors import ManifestError
from ckptfmt.format import layout
from ckptfmt.format.chunk_table import delta_depth, stored_key
from ckptfmt.format.limits import MAX_DELTA_DEPTH
from ckptfmt.format.manifest import Manifest
from ckptfmt.lifecycle.gc import collect
from ckptfmt.lifecycle.retention import Retention
from ckptfmt.saving.delta_bases import MAX_CHAIN
from tests.support.helpers import assert_bits
from tests.support.spec_reader import chunk_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool, torch.complex64]


def tensor_of(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(numel, generator=generator) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(numel, generator=generator, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), (numel,), generator=generator, dtype=dtype)


def nudged(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """A training step's worth of change: small updates to floats, a few flipped elements otherwise."""
    generator = torch.Generator().manual_seed(seed)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return tensor + (1e-3 * torch.randn(tensor.shape, generator=generator, dtype=torch.float32)).to(tensor.dtype)
    out = tensor.clone()
    where = torch.randint(0, tensor.numel(), (tensor.numel() // 50,), generator=generator)
    out[where] = tensor_of(tensor.dtype, len(where), seed + 1)
    return out


def training(steps: int, numel: int = 2**17) -> list[dict]:
    """States of a run: every dtype (each tensor over the 256 KiB packing threshold once float32), a
    frozen tensor, a small one packed with the plain values."""
    state = {f"t_{str(d).removeprefix('torch.')}": tensor_of(d, numel, i) for i, d in enumerate(DTYPES)}
    state["frozen"] = tensor_of(torch.float32, numel, 99)
    states = []
    for step in range(steps):
        state = {k: (v if k == "frozen" else nudged(v, 1000 * step + i)) for i, (k, v) in enumerate(state.items())}
        states.append({**state, "small": torch.full((3,), float(step)), "step": step})
    return states


def save_run(repo: str, states: list[dict], compression: str = "delta-zstd", **options) -> list[str]:
    urls = []
    for step, state in enumerate(states):
        urls.append(f"{repo}/step-{step:03d}")
        ckptfmt.save(state, urls[-1], step=step, compression=compression, chunk_size=2**17, **options)
    return urls


def assert_state(loaded: dict, state: dict, where: str) -> None:
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert_bits(loaded[key], value, f"{where} {key}")
        else:
            assert loaded[key] == value


def new_bytes(url: str) -> int:
    return ckptfmt.Repository.open(str(Path(url).parent)).commit(Path(url).name).totals["new_bytes"]


def manifest_of(url: str) -> Manifest:
    with ckptfmt.open(url) as reader:
        return reader.manifest


@pytest.mark.parametrize("compression", ["delta-zstd", "auto"])
def test_every_dtype_round_trips_bit_exact_through_a_chain_of_deltas(tmp_path, compression):
    states = training(4)
    urls = save_run(str(tmp_path / "repo"), states, compression)
    for url, state in zip(urls, states):
        assert_state(ckptfmt.load(url), state, url)
        assert_state(ckptfmt.load(url, mmap=False), state, url)
    assert ckptfmt.verify(str(tmp_path / "repo"), stats=True).ok
    last = manifest_of(urls[-1])
    deltas = [c for c in last.chunks if c.base is not None]
    assert deltas and max(delta_depth(last.chunks, i) for i in range(len(last.chunks))) == 3
    if compression == "delta-zstd":
        assert {c.codec for c in deltas} >= {"delta4-zstd", "delta2-zstd", "delta8-zstd"}
    else:  # 1.11: floating-point tensors as float deltas where a sample says so, the others as before
        assert {c.codec for c in deltas} <= {"floatdelta2-zstd", "floatdelta4-zstd", "floatdelta8-zstd",
                                             "delta2-zstd", "delta4-zstd", "delta8-zstd"}
        assert {"delta4-zstd", "delta8-zstd"} <= {c.codec for c in deltas}  # int32, int64, complex64
    frozen = {last.chunks[p.chunk] for s in last.tensors[[t.key for t in last.tensors].index("frozen")].shards
              for p in s.pieces}
    assert all(c.base is None for c in frozen)  # unchanged: the first save's chunks, reused as they are


def test_deltas_store_less_than_shuffled_zstd_and_what_does_not_pay_is_stored_whole(tmp_path):
    states = training(3)
    delta = save_run(str(tmp_path / "delta"), states)
    whole = save_run(str(tmp_path / "whole"), states, "shuffle-zstd")
    assert new_bytes(delta[2]) < 0.8 * new_bytes(whole[2])
    # Replace a tensor by fresh random values: its XOR with the old one is as random, no delta pays.
    changed = {**states[2], "t_float32": tensor_of(torch.float32, 2**17, 12345), "step": 3}
    url = f"{tmp_path}/delta/step-003"
    ckptfmt.save(changed, url, step=3, compression="delta-zstd", chunk_size=2**17)
    manifest = manifest_of(url)
    entry = next(t for t in manifest.tensors if t.key == "t_float32")
    assert all(manifest.chunks[p.chunk].codec == "shuffle4-zstd" for s in entry.shards for p in s.pieces)


def test_chains_are_bounded_and_restart_with_a_whole_chunk(tmp_path):
    states = training(MAX_CHAIN + 3, numel=2**16)
    urls = save_run(str(tmp_path / "repo"), states)
    depths = []
    for url in urls:
        manifest = manifest_of(url)
        entry = next(t for t in manifest.tensors if t.key == "t_float32")
        depths.append(delta_depth(manifest.chunks, entry.shards[0].pieces[0].chunk))
    assert depths == [0, *range(1, MAX_CHAIN + 1), 0, 1]
    assert_state(ckptfmt.load(urls[-1]), states[-1], urls[-1])


def test_retention_and_gc_keep_every_base_a_kept_checkpoint_needs(tmp_path):
    repo = str(tmp_path / "repo")
    states = training(5)
    urls = save_run(repo, states)
    doomed = [r.name for r in Retention(keep_last=1).to_delete(ckptfmt.Repository.open(repo).commits(), None)]
    assert len(doomed) == 4
    from ckptfmt.lifecycle.gc import remove

    remove(ckptfmt.Repository.open(repo), doomed)
    report = collect(ckptfmt.Repository.open(repo))
    assert report.chunks > 0  # the deleted checkpoints' own chunks went; their bases that step-004 needs did not
    assert ckptfmt.verify(repo).ok
    assert_state(ckptfmt.load(urls[-1]), states[-1], urls[-1])
    last = manifest_of(urls[-1])
    stored = {str(p.relative_to(repo)) for p in Path(repo, "chunks").rglob("*") if p.is_file()}
    assert stored == {stored_key(last.chunks, c) for c in last.chunks}


def test_replication_to_s3_and_repair_from_it_keep_deltas_exact(tmp_path, s3_bucket):
    repo, copy = str(tmp_path / "repo"), f"{s3_bucket}/copy"
    states = training(3)
    urls = save_run(repo, states)
    ckptfmt.replicate(repo, copy)
    for url, state in zip(urls, states):
        assert_state(ckptfmt.load(url.replace(repo, copy)), state, "copy")
    last = manifest_of(urls[-1])
    base_row = next(c.base for c in last.chunks if c.base is not None and last.chunks[c.base].base is not None)
    for row in (base_row, last.chunks[base_row].base):  # a delta that is a base, and the whole chunk under it
        Path(repo, stored_key(last.chunks, last.chunks[row])).unlink()
    assert not ckptfmt.verify(repo).ok
    report = ckptfmt.repair(repo, [copy])
    assert report.ok and len([f for f in report.fixed if f.kind == "chunk"]) == 2
    assert_state(ckptfmt.load(urls[-1]), states[-1], "repaired")


def test_a_missing_base_is_an_error_naming_the_delta_and_its_base(tmp_path):
    repo = str(tmp_path / "repo")
    urls = save_run(repo, training(2))
    manifest = manifest_of(urls[-1])
    delta = next(c for c in manifest.chunks if c.base is not None)
    base_key = stored_key(manifest.chunks, manifest.chunks[delta.base])
    Path(repo, base_key).unlink()
    with pytest.raises(ckptfmt.CheckpointNotFoundError) as error:
        ckptfmt.load(urls[-1])
    message = str(error.value)
    assert stored_key(manifest.chunks, delta) in message and base_key in message and "base chunk" in message
    problems = ckptfmt.verify(repo).problems
    assert {p.key for p in problems} >= {base_key}


def test_show_says_which_tensors_are_deltas_and_against_what(tmp_path, capsys):
    urls = save_run(str(tmp_path / "repo"), training(2))
    assert main(["show", urls[1]]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("deltas"))
    assert main(["show", urls[1], "--json"]) == 0
    tensors = {t["key"]: t["delta_of"] for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert tensors["t_float32"] == "step-000" and tensors["frozen"] is None and tensors["small"] is None
    deltas = [key for key, base in tensors.items() if base is not None]
    assert f"{len(deltas)} of 12 tensors stored against step-000 (the parent): {', '.join(deltas[:3])}" in line
    assert main(["show", urls[0]]) == 0
    assert "deltas" not in capsys.readouterr().out


def hostile(url: str, edit) -> Manifest:
    """The checkpoint's manifest with its chunk table edited, parsed again."""
    doc = manifest_of(url).to_dict()
    doc["chunks"] = chunk_rows(doc["chunks"])
    edit(doc["chunks"])
    return Manifest.from_bytes(msgpack.packb(doc, use_bin_type=True), "hostile")


@pytest.mark.parametrize("edit, message", [
    (lambda rows: rows[next(i for i, r in enumerate(rows) if "base" in r)].update(base=len(rows)), "not another row"),
    (lambda rows: rows[next(i for i, r in enumerate(rows) if "base" in r)].update(
        base=next(i for i, r in enumerate(rows) if "base" in r)), "not another row"),
    (lambda rows: rows[next(i for i, r in enumerate(rows) if "base" in r)].pop("base"), "base"),
    (lambda rows: rows[0].update(base=1) if "base" not in rows[0] else None, "has no base"),
], ids=["out-of-range", "itself", "missing", "on-a-whole-chunk"])
def test_a_hostile_chunk_table_is_refused(tmp_path, edit, message):
    urls = save_run(str(tmp_path / "repo"), training(2, numel=2**16))
    with pytest.raises(ManifestError, match=message):
        hostile(urls[1], edit)


def test_a_cycle_of_bases_or_a_base_of_another_size_is_refused(tmp_path):
    urls = save_run(str(tmp_path / "repo"), training(2, numel=2**16))

    def cycle(rows):
        first = next(i for i, r in enumerate(rows) if "base" in r)
        rows[rows[first]["base"]].update(codec=rows[first]["codec"], base=first)

    with pytest.raises(ManifestError, match=f"more than {MAX_DELTA_DEPTH} bases deep"):
        hostile(urls[1], cycle)

    def resized(rows):
        first = next(i for i, r in enumerate(rows) if "base" in r)
        rows[rows[first]["base"]]["size"] += 1

    with pytest.raises(ManifestError, match="its base chunk"):
        hostile(urls[1], resized)


def test_a_delta_key_names_its_base():
    digest, base = "ab" * 32, "cd" * 32
    assert layout.chunk_key(digest, "delta4-zstd", base) == f"chunks/ab/{digest}.delta4-zstd.{base}"
    with pytest.raises(ValueError):
        layout.chunk_key(digest, "delta4-zstd")
    with pytest.raises(ValueError):
        layout.chunk_key(digest, "zstd", base)
