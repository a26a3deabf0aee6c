"""safetensors import (single files, sharded sets with an index, folders) and export (one file or HF shards).

Files are written by safetensors itself (save_file / save_model), by hand for the
damaged ones, and by ckptfmt's export; everything is small.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile

import numpy as np
import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file, save_model

import ckptfmt
from ckptfmt import CheckpointError, CheckpointNotFoundError
from ckptfmt.cli import main
from ckptfmt.converters import safetensors_format as stf
from ckptfmt.converters.export import export_checkpoint
from ckptfmt.converters.export_files import parse_size
from ckptfmt.converters.importer import import_checkpoint, read_source
from tests.support.helpers import assert_tensor_exact, raw_bytes

# -- the import pipeline ------------------------------------------------------------------------------------


def import_into(src, url, kind: str | None = "safetensors"):
    """Import ``src`` as checkpoint ``url`` through the framework (the CLI's path)."""
    return import_checkpoint(os.fspath(src), os.fspath(url), kind=kind)


def assert_flat_equal(expected: dict, actual: dict) -> None:
    assert set(expected) == set(actual)
    for name, tensor in expected.items():
        assert_tensor_exact(tensor, actual[name], name)


def random_tensor(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs included), via bytes; bools are 0/1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def header_of(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def write_raw(path, header: dict, buffer: bytes, *, length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length) + raw + buffer)


# -- dtypes ---------------------------------------------------------------------------------------------

SUPPORTED = {st: getattr(torch, name) for st, (name, _) in stf.SAFETENSORS_DTYPES.items()
             if isinstance(getattr(torch, name, None), torch.dtype)}


def test_dtype_table_covers_safetensors():
    """Every dtype the installed safetensors maps for torch is in the table, with the same torch dtype."""
    import safetensors.torch as st_torch

    for st, dtype in st_torch._TYPES.items():
        if dtype is not None:
            assert SUPPORTED.get(st) == dtype, st
    for required in ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64",
                     "BOOL", "F8_E4M3", "F8_E5M2", "C64"):
        assert required in SUPPORTED


def test_every_dtype_round_trip_bit_exact(tmp_path):
    tensors = {}
    for i, (st, dtype) in enumerate(sorted(SUPPORTED.items())):
        tensors[f"model.layers.{i}.{st.lower()}"] = random_tensor(dtype, (3, 4), seed=i)
        if st != "F4":  # a 0-d float4 pair is not a whole number of safetensors F4 values
            tensors[f"scalar.{st.lower()}"] = random_tensor(dtype, (), seed=100 + i)
        tensors[f"empty.{st.lower()}"] = torch.empty((0, 2), dtype=dtype)
    src = tmp_path / "all.safetensors"
    save_file(tensors, src, metadata={"format": "pt"})
    written = {v["dtype"] for k, v in header_of(src).items() if k != "__metadata__"}
    assert written == set(SUPPORTED)  # the file really holds every dtype under its safetensors name
    assert header_of(src)["model.layers.0.bf16"]["shape"] == [3, 4]

    imported = stf.read(str(src))
    assert_flat_equal(tensors, imported.state)
    url = tmp_path / "repo" / "imported"
    import_into(src, url)
    loaded = ckptfmt.load(url)
    assert_flat_equal(tensors, loaded)  # same names: dotted names stay flat keys
    # and what safetensors itself reads, for the dtypes its loader knows (its writer has more)
    import safetensors.torch as st_torch

    known = {k for k, t in tensors.items() if t.dtype in st_torch._TYPES.values()}
    assert len(known) >= 3 * 16
    with safe_open(src, framework="pt") as f:
        for k in known:
            assert_tensor_exact(f.get_tensor(k), loaded[k], k)
    only_known = tmp_path / "known.safetensors"
    save_file({k: tensors[k] for k in known}, only_known)
    reference = load_file(only_known)
    assert set(reference) == known
    for k, t in reference.items():
        assert_tensor_exact(t, loaded[k], k)


def test_f4_shape_counts_nibbles(tmp_path):
    if "F4" not in SUPPORTED:
        pytest.skip("torch has no float4_e2m1fn_x2")
    t = random_tensor(SUPPORTED["F4"], (2, 3), seed=7)
    src = tmp_path / "f4.safetensors"
    save_file({"w": t}, src)
    assert header_of(src)["w"]["shape"] == [2, 6]
    out = stf.read(str(src)).state["w"]
    assert out.dtype == t.dtype and out.shape == (2, 3) and torch.equal(raw_bytes(out), raw_bytes(t))


def test_metadata_preserved_and_tensors_are_memory_mapped(tmp_path):
    src = tmp_path / "m.safetensors"
    tensors = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(2, dtype=torch.int64)}
    meta = {"format": "pt", "producer": "unit test", "lr": "0.001"}
    save_file(tensors, src, metadata=meta)
    imported = stf.read(str(src))
    assert imported.kind == "safetensors" and imported.step is None and imported.rng is None
    assert imported.metadata["safetensors_metadata"] == meta
    assert imported.versions == {"safetensors_format": "pt"}
    assert imported.opaque == [] and imported.notes == []
    # zero copy: every tensor is a view into one mapping of the file, at its offset in the file
    header = stf.read_header(str(src))
    assert header.data_start % 8 == 0
    offsets = {spec.name: spec.begin for spec in header.tensors}
    ptrs = {k: t.data_ptr() for k, t in imported.state.items()}
    assert ptrs["b"] - ptrs["a.weight"] == offsets["b"] - offsets["a.weight"]
    before = src.read_bytes()
    imported.state["a.weight"].add_(1)  # copy-on-write: the file never changes
    assert src.read_bytes() == before
    imported = stf.read(str(src))
    url = tmp_path / "repo" / "m"
    result = import_into(src, url, kind=None)  # detected
    assert result.kind == "safetensors" and result.tensors == 2
    with ckptfmt.open(url) as ckpt:
        assert ckpt.metadata["user"]["safetensors_metadata"] == meta
        provenance = ckpt.metadata["provenance"]
        assert provenance["source_kind"] == "safetensors" and provenance["versions"] == {"safetensors_format": "pt"}
    assert_flat_equal(tensors, ckptfmt.load(url))


def test_save_model_file(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    src = tmp_path / "model.safetensors"
    save_model(model, str(src), metadata={"format": "pt"})
    url = tmp_path / "repo" / "model"
    import_into(src, url)
    assert_flat_equal(load_file(src), ckptfmt.load(url))
    assert set(ckptfmt.load(url)) == set(model.state_dict())


# -- sharded sets -----------------------------------------------------------------------------------------


def make_sharded(folder, *, index_extra: dict | None = None, missing: str | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    first = {"model.embed.weight": random_tensor(torch.float32, (8, 4), 1),
             "model.layers.0.weight": random_tensor(torch.bfloat16, (4, 4), 2)}
    second = {"model.layers.1.weight": random_tensor(torch.float16, (4, 4), 3),
              "lm_head.bias": random_tensor(torch.float32, (8,), 4)}
    save_file(first, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(second, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in first},
                  **{k: "model-00002-of-00002.safetensors" for k in second}}
    weight_map.update(index_extra or {})
    total = sum(t.numel() * t.element_size() for t in [*first.values(), *second.values()])
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / stf.INDEX_NAME).write_text(json.dumps(index))
    if missing:
        os.unlink(folder / missing)
    return {**first, **second}


@pytest.mark.parametrize("given", ["index", "folder"])
def test_sharded_with_index(tmp_path, given):
    folder = tmp_path / "hf"
    expected = make_sharded(folder)
    src = folder / stf.INDEX_NAME if given == "index" else folder
    assert stf.detect(str(src))
    imported = stf.read(str(src))
    reference = {**load_file(folder / "model-00001-of-00002.safetensors"),
                 **load_file(folder / "model-00002-of-00002.safetensors")}
    assert_flat_equal(reference, imported.state)
    assert_flat_equal(expected, imported.state)
    assert imported.metadata["safetensors_metadata"] == {"format": "pt"}
    assert imported.metadata["safetensors_index_metadata"]["total_size"] > 0
    assert imported.notes == []
    url = tmp_path / "repo" / given
    assert import_into(src, url, kind=None).kind == "safetensors"  # detected
    assert_flat_equal(reference, ckptfmt.load(url))


def test_index_quirks_are_tolerated_and_noted(tmp_path, monkeypatch):
    folder = tmp_path / "hf"
    expected = make_sharded(folder)
    index = json.loads((folder / stf.INDEX_NAME).read_text())
    index["weight_map"] = {k: "./" + v for k, v in index["weight_map"].items()}
    del index["weight_map"]["lm_head.bias"]  # in a shard, not in the index: imported, noted
    index["metadata"]["total_size"] += 1
    (folder / stf.INDEX_NAME).write_text(json.dumps(index))
    monkeypatch.chdir(folder)  # a bare relative index path
    imported = stf.read(stf.INDEX_NAME)
    assert_flat_equal(expected, imported.state)
    assert list(imported.state)[-1] == "lm_head.bias"
    assert any("'lm_head.bias' is not in the index" in n for n in imported.notes)
    assert any("total_size" in n for n in imported.notes)


def test_folder_of_files_without_index(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    a, b = {"x": torch.ones(2)}, {"y": torch.zeros(3, dtype=torch.int8)}
    save_file(a, folder / "a.safetensors")
    save_file(b, folder / "b.safetensors")
    assert stf.detect(str(folder))
    assert_flat_equal({**a, **b}, stf.read(str(folder)).state)
    save_file({"x": torch.ones(1)}, folder / "c.safetensors")
    with pytest.raises(CheckpointError, match="c.safetensors.*'x'|'x'.*c.safetensors"):
        stf.read(str(folder))


def test_detect(tmp_path):
    save_file({"x": torch.ones(2)}, tmp_path / "w.safetensors")
    os.link(tmp_path / "w.safetensors", tmp_path / "weights.bin")
    (tmp_path / "other.pt").write_bytes(b"PK\x03\x04 not safetensors")
    (tmp_path / "empty").mkdir()
    assert stf.detect(str(tmp_path / "w.safetensors"))
    assert stf.detect(str(tmp_path / "weights.bin"))  # content sniffing
    assert not stf.detect(str(tmp_path / "other.pt"))
    assert not stf.detect(str(tmp_path / "empty"))
    assert not stf.detect(str(tmp_path / "nothing.safetensors"))
    assert read_source(tmp_path / "weights.bin").kind == "safetensors"
    with pytest.raises(CheckpointError, match="other.pt"):
        read_source(tmp_path / "other.pt")


# -- damaged input -------------------------------------------------------------------------------------------

GOOD_HEADER = {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


def _f32(begin: int, count: int = 1) -> dict:
    return {"dtype": "F32", "shape": [count], "data_offsets": [begin, begin + 4 * count]}


#: Buffers the tensors do not tile exactly: (header, buffer, what the error must say). safetensors
#: refuses each ("file not fully covered", "invalid offset").
COVERAGE = {
    "trailing_bytes": ({"w": _f32(0, 2)}, b"\x00" * 12,
                       r"file not fully covered: 4 byte\(s\) after the last tensor, 'w', .*"
                       r"file offsets \[\d+, \d+\), data offsets \[8, 12\)"),
    "trailing_no_tensor": ({}, b"\x00" * 4, r"file not fully covered: 4 byte\(s\) after the header.*\[0, 4\)"),
    "hole": ({"a": _f32(0), "b": _f32(8)}, b"\x00" * 12,
             r"file not fully covered: 4 byte\(s\) between tensors 'a' and 'b'.*data offsets \[4, 8\)"),
    "leading_hole": ({"a": _f32(4)}, b"\x00" * 8,
                     r"file not fully covered: 4 byte\(s\) before the first tensor, 'a'.*data offsets \[0, 4\)"),
    "overlap": ({"a": _f32(0, 2), "b": _f32(4, 2)}, b"\x00" * 12, r"'b' \(bytes 4-12\) overlaps tensor 'a'"),
    "empty_inside": ({"a": _f32(0, 2), "e": _f32(4, 0)}, b"\x00" * 8, r"'e' \(bytes 4-4\) overlaps tensor 'a'"),
}


def write_zip_polyglot(path) -> None:
    """A file written by safetensors with a zip archive appended: zipfile opens it too."""
    save_file({"w": torch.ones(4)}, path)
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("hello.txt", "not a tensor")
    with open(path, "ab") as f:
        f.write(archive.getvalue())


def _damage(kind: str, tmp_path):
    """Write a damaged input; returns (path given to the importer, file the error must name)."""
    p = tmp_path / "bad.safetensors"
    if kind == "empty":
        p.write_bytes(b"")
    elif kind == "truncated_length":
        p.write_bytes(b"\x10\x00\x00")
    elif kind == "header_past_eof":
        write_raw(p, GOOD_HEADER, b"", length=10_000)
    elif kind == "absurd_header":
        p.write_bytes(struct.pack("<Q", 2**40) + b"{}" + b"\x00" * 64)
    elif kind == "not_json":
        raw = b"this is not json at all"
        p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00" * 16)
    elif kind == "not_object":
        write_raw(p, [1, 2, 3], b"")
    elif kind == "truncated_buffer":
        write_raw(p, GOOD_HEADER, b"\x00" * 10)
    elif kind == "offsets_outside":
        write_raw(p, {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}}, b"\x00" * 16)
    elif kind == "offsets_negative":
        write_raw(p, {"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, b"\x00" * 16)
    elif kind in COVERAGE:
        header, buffer, _ = COVERAGE[kind]
        write_raw(p, header, buffer)
    elif kind == "zip_polyglot":
        write_zip_polyglot(p)
    elif kind == "size_mismatch":
        write_raw(p, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\x00" * 16)
    elif kind == "unknown_dtype":
        write_raw(p, {"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\x00" * 16)
    elif kind == "bad_shape":
        write_raw(p, {"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\x00")
    elif kind == "duplicate_name":
        raw = (b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
               b'"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}')
        p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00\x00")
    elif kind == "bad_metadata":
        write_raw(p, {"__metadata__": {"n": 1}, **{k: v for k, v in GOOD_HEADER.items() if k != "__metadata__"}},
                  b"\x00" * 16)
    elif kind in ("missing_shard", "tensor_not_in_shard", "index_not_json", "index_traversal"):
        folder = tmp_path / "hf"
        if kind == "missing_shard":
            make_sharded(folder, missing="model-00002-of-00002.safetensors")
            return folder, "model-00002-of-00002.safetensors"
        if kind == "tensor_not_in_shard":
            make_sharded(folder, index_extra={"model.ghost": "model-00002-of-00002.safetensors"})
            return folder / stf.INDEX_NAME, "model-00002-of-00002.safetensors"
        make_sharded(folder)
        if kind == "index_not_json":
            (folder / stf.INDEX_NAME).write_text("{ not json")
        else:
            (folder / stf.INDEX_NAME).write_text(json.dumps({"weight_map": {"x": "../secret.safetensors"}}))
        return folder, stf.INDEX_NAME
    else:  # pragma: no cover
        raise AssertionError(kind)
    return p, "bad.safetensors"


DAMAGE = ["empty", "truncated_length", "header_past_eof", "absurd_header", "not_json", "not_object",
          "truncated_buffer", "offsets_outside", "offsets_negative", *COVERAGE, "zip_polyglot", "size_mismatch",
          "unknown_dtype", "bad_shape", "duplicate_name", "bad_metadata", "missing_shard", "tensor_not_in_shard",
          "index_not_json", "index_traversal"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_input_raises_naming_the_file_and_commits_nothing(tmp_path, kind):
    src, named = _damage(kind, tmp_path)
    with pytest.raises(CheckpointError) as info:
        stf.read(str(src))
    assert named in str(info.value), str(info.value)
    repo = tmp_path / "repo"
    with pytest.raises(CheckpointError) as info:
        import_into(src, repo / "imported")
    assert named in str(info.value), str(info.value)
    if repo.exists():
        assert ckptfmt.Repository.open(repo).names() == []


def test_missing_input_and_errors_are_specific(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        stf.read(str(tmp_path / "nope.safetensors"))
    src, _ = _damage("missing_shard", tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="missing"):
        stf.read(str(src))
    with pytest.raises(ckptfmt.CorruptDataError, match="overlaps"):
        stf.read(str(_damage("overlap", tmp_path)[0]))


@pytest.mark.parametrize("kind", COVERAGE)
def test_buffer_not_tiled_exactly_is_refused_as_safetensors_refuses_it(tmp_path, kind):
    """Bytes no tensor covers (trailing, before the first tensor, between two) and overlapping tensors."""
    src, _ = _damage(kind, tmp_path)
    with pytest.raises(SafetensorError, match="file not fully covered|invalid offset"):
        safe_open(src, framework="pt")
    with pytest.raises(ckptfmt.CorruptDataError, match=COVERAGE[kind][2]):
        stf.read(str(src))


def test_zip_polyglot_is_refused_naming_the_uncovered_bytes(tmp_path):
    """safetensors' polyglot case: a valid file with another file's bytes after its data."""
    src = tmp_path / "poly.safetensors"
    write_zip_polyglot(src)
    assert zipfile.ZipFile(src).read("hello.txt") == b"not a tensor"
    with pytest.raises(SafetensorError, match="file not fully covered"):
        load_file(src)
    size = src.stat().st_size
    (n,) = struct.unpack("<Q", src.read_bytes()[:8])
    extra = size - (8 + n + 16)
    with pytest.raises(ckptfmt.CorruptDataError) as info:
        stf.read(str(src))
    assert str(info.value) == (
        f"{src}: file not fully covered: {extra} byte(s) after the last tensor, 'w', belong to no tensor "
        f"(file offsets [{8 + n + 16}, {size}), data offsets [16, {16 + extra}))"
    )


def test_cli_refuses_the_polyglot_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "500")
    src = tmp_path / "poly.safetensors"
    write_zip_polyglot(src)
    dest = tmp_path / "repo" / "poly"
    assert main(["import", str(src), str(dest)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("ckptfmt: error:") and "file not fully covered" in captured.err
    assert "after the last tensor, 'w'" in captured.err and "poly.safetensors" in captured.err
    assert not (tmp_path / "repo").exists() or ckptfmt.Repository.open(tmp_path / "repo").names() == []


# -- export ------------------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(16, 16) for i in range(4)}
    model["layers.0.bias"] = torch.randn(16).to(torch.bfloat16)
    model["mask"] = torch.tensor([True, False, True])
    model["scale"] = torch.tensor(2.5, dtype=torch.float64)
    model["fp8"] = random_tensor(torch.float8_e4m3fn, (5,), 9)
    model["tied"] = model["layers.1.weight"]  # stored once by ckptfmt, twice by safetensors
    state = {"model": model, "optimizer": {"state": {0: {"exp_avg": torch.zeros(16, 16)}}}, "step": 3,
             "extra": {"counts": np.arange(4, dtype=np.int32)}}
    url = tmp_path / "repo" / "step-3"
    ckptfmt.save(state, url, step=3)
    return url, model


def test_export_single_file_default_names(saved, tmp_path):
    url, model = saved
    dest = tmp_path / "out.safetensors"
    result = export_checkpoint(url, dest, format="safetensors")
    assert result.path == str(dest) and result.tensors == len(model) + 2
    flat = load_file(dest)
    assert set(flat) == {f"model/{k}" for k in model} | {"optimizer/state/0/exp_avg", "extra/counts"}
    assert torch.equal(flat["extra/counts"], torch.arange(4, dtype=torch.int32))
    for k, t in model.items():
        assert_tensor_exact(t, flat[f"model/{k}"], k)
    assert "safetensors holds tensors only: the state's plain values are not exported (1: step)" in result.notes
    assert any("model/tied is the same tensor as model/layers.1.weight" in n for n in result.notes)
    with safe_open(dest, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "ckptfmt.step": "3"}  # no provenance unless asked for


def test_export_sharded_with_prefix_and_import_back(saved, tmp_path):
    url, model = saved
    dest = tmp_path / "hf-out"
    result = export_checkpoint(url, dest, format="safetensors", max_shard_size=1500, prefix="model/")
    index = json.loads((dest / stf.INDEX_NAME).read_text())
    shards = sorted(p.name for p in dest.glob("*.safetensors"))
    count = len(shards)
    assert count >= 3 and shards == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert set(index["weight_map"]) == set(model)  # prefix stripped; the optimizer is not under it
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.values())
    seen = {}
    for shard in shards:
        part = load_file(dest / shard)
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 1500
        for k, t in part.items():
            assert index["weight_map"][k] == shard and k not in seen
            seen[k] = t
    assert_flat_equal(model, seen)
    assert result.tensors == len(model) and any("outside 'model/'" in n for n in result.notes)
    assert not any("plain values" in n for n in result.notes)  # the state's 'step' is outside the prefix
    assert not [p for p in dest.iterdir() if ".tmp-" in p.name]
    # and back in
    imported = stf.read(str(dest))
    assert_flat_equal(model, imported.state)
    assert imported.metadata["safetensors_metadata"]["ckptfmt.prefix"] == "model/"
    import_into(dest, tmp_path / "repo2" / "back", kind=None)
    assert_flat_equal(model, ckptfmt.load(tmp_path / "repo2" / "back"))


def test_export_one_shard_and_folder_dest(saved, tmp_path):
    url, model = saved
    dest = tmp_path / "one"
    export_checkpoint(url, dest, format="safetensors", max_shard_size="5GB", prefix="model")
    assert sorted(p.name for p in dest.iterdir()) == sorted([stf.INDEX_NAME, "model-00001-of-00001.safetensors"])
    assert_flat_equal(model, load_file(dest / "model-00001-of-00001.safetensors"))
    existing = tmp_path / "existing"
    existing.mkdir()
    export_checkpoint(url, existing, format="safetensors")  # an existing folder: HF layout, 5GB shards
    assert (existing / stf.INDEX_NAME).is_file()


def test_export_errors(saved, tmp_path):
    url, _ = saved
    with pytest.raises(CheckpointError, match="no tensor key starts with 'decoder/'"):
        export_checkpoint(url, tmp_path / "x", format="safetensors", prefix="decoder/")
    with pytest.raises(CheckpointError, match="shard size"):
        export_checkpoint(url, tmp_path / "x", format="safetensors", max_shard_size="lots")
    with pytest.raises(CheckpointError, match="safetensors only"):
        export_checkpoint(url, tmp_path / "x.pt", format="torch", prefix="model/")
    assert not (tmp_path / "x").exists()
    ckptfmt.save({"a/b": torch.ones(1), "a": {"b": torch.zeros(1)}}, tmp_path / "repo" / "clash")
    with pytest.raises(CheckpointError, match="tensors 'a%2Fb' and 'a/b' would both be named 'a/b'"):
        export_checkpoint(tmp_path / "repo" / "clash", tmp_path / "clash.safetensors", format="safetensors")
    assert not (tmp_path / "clash.safetensors").exists()


def test_parse_size():
    assert parse_size(123) == 123
    assert parse_size("123") == 123
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("100MB") == 100 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5kb") == 1500
    for bad in ("0", -1, "5XB", "", True, 1.5):
        with pytest.raises(CheckpointError):
            parse_size(bad)


@pytest.mark.parametrize("shard", [None, 1500])
def test_export_streams_one_tensor_at_a_time(saved, tmp_path, monkeypatch, shard):
    """Each tensor is read when its turn comes and released before the next is read."""
    import weakref

    url, model = saved
    original = ckptfmt.CheckpointReader.get_tensor
    alive: list = []
    peak = [0]

    def tracking(self, key):
        value = original(self, key)
        alive[:] = [r for r in alive if r() is not None]
        peak[0] = max(peak[0], len(alive))
        alive.append(weakref.ref(value))
        return value

    monkeypatch.setattr(ckptfmt.CheckpointReader, "get_tensor", tracking)
    dest = tmp_path / ("one.safetensors" if shard is None else "shards")
    result = export_checkpoint(url, dest, format="safetensors", max_shard_size=shard, prefix="model/")
    assert result.tensors == len(model) and peak[0] == 0  # none alive when the next was read


# -- round trip: an import then an export gives back the file ----------------------------------------------


def round_trip_tensors() -> dict:
    """Every dtype twice, under names out of order; a scalar, an empty tensor; names with '/', '%' and non-ASCII."""
    tensors = {}
    for i, (st, dtype) in enumerate(sorted(SUPPORTED.items())):
        tensors[f"z.{st.lower()}"] = random_tensor(dtype, (3, 4), seed=i)
        tensors[f"a.{st.lower()}"] = random_tensor(dtype, (2,), seed=50 + i)
    tensors["model/layers.0.weight"] = random_tensor(torch.float32, (2, 3), 90)
    tensors["100%/\u00e9"] = random_tensor(torch.bfloat16, (), 91)
    tensors["empty"] = torch.empty((0, 3), dtype=torch.float16)
    return tensors


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"},
                                      {"format": "pt", "producer": "unit test", "lr": "0.001",
                                       "text": "\u00e9\n\x01\x7f/\u2028\U0001f600\"quoted\""}],
                         ids=["none", "empty", "format", "several"])
def test_import_then_export_gives_back_the_file_byte_for_byte(tmp_path, metadata):
    src = tmp_path / "src.safetensors"
    save_file(round_trip_tensors(), src, metadata=metadata)
    url = tmp_path / "repo" / "imported"
    import_into(src, url)
    out = tmp_path / "out.safetensors"
    result = export_checkpoint(url, out, format="safetensors")
    assert header_of(out) == header_of(src)
    assert out.read_bytes() == src.read_bytes()
    assert result.notes == []  # no "plain values are not exported": the import recorded none


def test_provenance_is_added_only_when_asked_for(tmp_path, capsys):
    src = tmp_path / "src.safetensors"
    meta = {"format": "pt", "producer": "unit test"}
    save_file({"w": torch.arange(6.0), "b": torch.ones(2, dtype=torch.int8)}, src, metadata=meta)
    url = tmp_path / "repo" / "imported"
    import_into(src, url)
    out = tmp_path / "out.safetensors"
    export_checkpoint(url, out, format="safetensors", provenance=True)
    with ckptfmt.open(url) as reader:
        expected = {**meta, "ckptfmt.source": reader.url, "ckptfmt.id": reader.id}
    with safe_open(out, framework="pt") as f:
        assert f.metadata() == expected
    assert_flat_equal(load_file(src), load_file(out))
    for flags, same_as in (["--provenance"], out), ([], src):
        dest = tmp_path / f"cli{len(flags)}.safetensors"
        assert main(["export", str(url), str(dest), "--format", "safetensors", *flags]) == 0
        assert dest.read_bytes() == same_as.read_bytes()
    assert "note:" not in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="provenance apply to --format safetensors only"):
        export_checkpoint(url, tmp_path / "x.pt", format="torch", provenance=True)


def test_plain_values_note_only_when_an_export_leaves_plain_values_out(tmp_path):
    """A safetensors import records its metadata beside the state, not in it: its export notes nothing.
    A state with plain values gets a note naming those under the exported prefix."""
    make_sharded(tmp_path / "hf")
    import_into(tmp_path / "hf", tmp_path / "repo" / "hf")
    result = export_checkpoint(tmp_path / "repo" / "hf", tmp_path / "out", format="safetensors")
    assert result.notes == []
    state = {"model": {"w": torch.ones(2), "lr": 0.1, "betas": (0.9, 0.99), "empty": {}}, "step": 3}
    ckptfmt.save(state, tmp_path / "repo" / "plain", step=3)
    result = export_checkpoint(tmp_path / "repo" / "plain", tmp_path / "p.safetensors", format="safetensors",
                               prefix="model/")
    assert result.notes == ["safetensors holds tensors only: the state's plain values are not exported "
                            "(2: model/lr, model/betas)"]
