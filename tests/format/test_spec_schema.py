"""spec/: the JSON Schemas match real checkpoints, and FORMAT.md suffices to read and write one.

* Real checkpoints written by ``ckptfmt.save`` validate against
  spec/{manifest,commit,repository}.schema.json (Draft 2020-12), through the
  msgpack -> JSON image of FORMAT.md section 15; broken documents do not.
* ``SpecReader`` is a reader written from FORMAT.md alone (msgpack, blake3,
  and zstandard for compressed chunks; no ckptfmt code): it reassembles every
  tensor of a real checkpoint, verifying every hash, and matches what was saved.
* ``write_by_spec`` is a writer written from FORMAT.md alone: it lays out a
  multi-shard, multi-piece, partly compressed checkpoint by hand, and
  ckptfmt's own reader loads it.
* Delta chunks (FORMAT.md 4.1, 5.5): ``SpecReader`` reads runs of delta saves
  (chains 1 to 8 deep, elements of 1 to 16 bytes) bit-exactly, and ckptfmt
  reads a delta chunk the text's writer stored.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import struct
from collections import OrderedDict
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from tests.support.helpers import require_module
from tests.support.spec_reader import (
    SpecReader,
    blake3_hex,
    chunk_rows,
    json_image,
    shuffle,
    store_chunk,
    tensor_rows,
    tree_hook,
    unpack,
    unshuffle,
    write_by_spec,
)

jsonschema = require_module("jsonschema")

import ckptfmt

SPEC = Path(__file__).resolve().parents[2] / "spec"
CHUNK_SIZE = 64 * 2**10


def _schema(name: str) -> dict:
    return json.loads((SPEC / name).read_text(encoding="utf-8"))


def _validator(name: str) -> jsonschema.Draft202012Validator:
    schema = _schema(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


# -- the JSON image of msgpack data (FORMAT.md section 15) ---------------------





# -- a checkpoint written by ckptfmt ------------------------------------------

def _state() -> dict:
    gen = torch.Generator().manual_seed(1234)
    tied = torch.randn(4, 4, generator=gen)
    return {
        "model": {
            # 360,000 bytes >= 256 KiB: split into 64 KiB chunks (6 chunks, the last shorter)
            "big": torch.randn(300, 300, generator=gen),
            # 320,000 bytes of bfloat16: split too (shuffle2-zstd when compressed)
            "big_bf16": torch.randn(400, 400, generator=gen).to(torch.bfloat16),
            "small": tied,
            "bf16": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
            "bias": torch.nn.Parameter(torch.randn(7, generator=gen)),
        },
        "layers": {0: torch.arange(6, dtype=torch.int64), 1: torch.ones(2, 3, dtype=torch.float16)},
        "tied": tied,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "np": np.arange(5, dtype=np.int16),
        "step": 3,
        "misc": (1, 2**70, float("nan"), {"a", "b"}, OrderedDict(x=1), torch.float16),
    }


def _expected_bytes(value) -> bytes:
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).tobytes()
    return value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _tensor_leaves(state: dict) -> dict[str, object]:
    """key -> saved tensor, with the keys FORMAT.md section 6.7 prescribes."""
    m = state["model"]
    return {
        "model/big": m["big"], "model/big_bf16": m["big_bf16"], "model/small": m["small"],
        "model/bf16": m["bf16"], "model/bias": m["bias"],
        "layers/0": state["layers"][0], "layers/1": state["layers"][1],
        "tied": state["tied"], "scalar": state["scalar"], "empty": state["empty"], "np": state["np"],
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A repository with two checkpoints: 'plain' (codec none) and 'packed-z' (shuffle-zstd)."""
    repo = tmp_path_factory.mktemp("spec") / "repo"
    state = _state()
    timer = ckptfmt.StepTimer()
    for step in range(3):
        with timer.step(step):
            timer.batch(torch.arange(4 * step, 4 * step + 4))
            with timer.phase("forward"):
                pass
            if step:
                with timer.phase("backward"):
                    pass
        timer.metrics(loss=1.0 / (step + 1))
    ckptfmt.save(state, f"{repo}/plain", step=3, chunk_size=CHUNK_SIZE, metadata={"lr": 0.001, 7: "seven"},
                 timer=timer)
    ckptfmt.save(state, f"{repo}/packed-z", step=4, chunk_size=CHUNK_SIZE, compression="shuffle-zstd")
    return repo, state


def _manifest_bytes(repo: Path, name: str) -> bytes:
    commit = json.loads((repo / name / "COMMIT").read_bytes())
    return (repo / name / f"manifest-{commit['manifest']}.msgpack").read_bytes()


# -- schema tests -------------------------------------------------------------

def test_schemas_are_valid_draft_2020_12():
    for name in ("manifest.schema.json", "commit.schema.json", "repository.schema.json"):
        schema = _schema(name)
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("name", ["plain", "packed-z"])
def test_real_checkpoint_matches_schemas(saved, name):
    repo, _ = saved
    _validator("repository.schema.json").validate(json.loads((repo / "ckptfmt.json").read_bytes()))
    _validator("commit.schema.json").validate(json.loads((repo / name / "COMMIT").read_bytes()))
    manifest = unpack(_manifest_bytes(repo, name))
    _validator("manifest.schema.json").validate(json_image(manifest))
    assert isinstance(manifest["tensors"], dict) and isinstance(manifest["chunks"], dict)  # in columns (1.12, 1.13)
    _validator("manifest.schema.json").validate(json_image({**manifest, "tensors": tensor_rows(manifest["tensors"]),
                                                            "chunks": chunk_rows(manifest["chunks"])}))
    # The fixture exercises what it claims to: split, packed, compressed, empty, 0-dim, tied, int keys.
    tensors = tensor_rows(manifest["tensors"])
    big = next(t for t in tensors if t["key"] == "model/big")
    assert len(big["shards"][0]["pieces"]) == math.ceil(300 * 300 * 4 / CHUNK_SIZE) == 6
    keys = [t["key"] for t in tensors]
    assert {"layers/0", "layers/1", "scalar", "empty", "tied"} <= set(keys)
    assert any(t.get("same_as") is not None for t in tensors)
    codecs = {c["codec"] for c in chunk_rows(manifest["chunks"])}
    assert codecs == ({"none"} if name == "plain" else {"zstd", "shuffle2-zstd", "shuffle4-zstd"})
    steps = manifest["timing"]["ranks"][0].get("steps")
    if name == "plain":  # the step records of spec 9.4, with a phase that starts at the second step
        assert steps["count"] == 3 and steps["step"] == struct.pack("<3q", 0, 1, 2)
        backward = struct.unpack("<3d", steps["phases"]["backward"])
        assert math.isnan(backward[0]) and backward[1] >= 0
    else:
        assert steps is None


def test_schema_vocabulary_and_limits_match_the_implementation():
    from ckptfmt.format import codecs, dtypes, limits

    defs = _schema("manifest.schema.json")["$defs"]
    assert set(defs["dtype"]["enum"]) == set(dtypes.ITEMSIZES)
    assert set(defs["codec"]["enum"]) == set(codecs.CODECS)
    assert defs["chunk"]["properties"]["size"]["maximum"] == limits.MAX_CHUNK_BYTES
    # A piece lies within its chunk, in both forms of shards (FORMAT.md 6.5, 6.11, 14): offset and length
    # are bounded by a chunk's size, in the schema as in the reader.
    assert [item.get("maximum") for item in defs["piece"]["prefixItems"][1:]] == [limits.MAX_CHUNK_BYTES] * 2
    assert defs["dims"]["maxItems"] == limits.MAX_DIMS
    assert defs["tensor"]["properties"]["key"]["maxLength"] == limits.MAX_KEY_BYTES
    shard_list, grid = defs["tensor"]["properties"]["shards"]["oneOf"]
    assert shard_list["maxItems"] == limits.MAX_SHARDS_PER_TENSOR
    assert grid["$ref"] == "#/$defs/shard_grid"
    assert defs["shard_grid"]["properties"]["cells"]["items"]["maximum"] == limits.MAX_SHARDS_PER_TENSOR
    top = _schema("manifest.schema.json")["properties"]
    assert top["chunks"]["maxItems"] == limits.MAX_CHUNKS
    assert top["tensors"]["maxItems"] == limits.MAX_TENSORS
    assert defs["name"]["pattern"] == f"^{limits.NAME_PATTERN.pattern}$"
    names = jsonschema.Draft202012Validator(defs["name"])  # reserved names refused in any letter case (spec 4.2)
    for reserved in limits.RESERVED_NAMES:
        for name in (reserved, reserved.upper(), reserved.title(), reserved.swapcase()):
            assert not names.is_valid(name) and not limits.is_valid_name(name), name
        assert names.is_valid(reserved + "2") and limits.is_valid_name(reserved + "2")
    assert defs["hash"]["pattern"] == f"^{limits.HASH_PATTERN.pattern}$"
    commit = _schema("commit.schema.json")["properties"]
    assert commit["manifest_size"]["maximum"] == limits.MAX_MANIFEST_BYTES


def _bad_manifests(good: dict, rows: list, chunks: list):
    """Documents the schema refuses: ``good`` (its tables in columns) and, for the row form, ``good``
    with the tensor table ``rows`` and the chunk table ``chunks``."""
    def edit(fn):
        doc = copy.deepcopy(good)
        fn(doc)
        return doc

    yield "columns: unknown dtype", edit(lambda d: d["tensors"]["dtypes"].append("qint8"))
    yield "columns: a column not a bin", edit(lambda d: d["tensors"].update(ndim=[2]))
    yield "columns: no dims", edit(lambda d: d["tensors"].pop("dims"))
    yield "columns: rows without row_at", edit(lambda d: d["tensors"].pop("row_at"))
    yield "columns: statistics without a set", edit(lambda d: d["tensors"]["stats"].pop("set"))
    yield "chunk columns: unknown codec", edit(lambda d: d["chunks"]["codecs"].append("lz4"))
    yield "chunk columns: hashes as a list", edit(lambda d: d["chunks"].update(hash=[d["chunks"]["hash"]]))
    yield "chunk columns: no sizes", edit(lambda d: d["chunks"].pop("size"))
    good = {**good, "tensors": rows, "chunks": chunks}

    yield "uppercase hash", edit(lambda d: d["chunks"][0].update(hash=d["chunks"][0]["hash"].upper()))
    yield "short hash", edit(lambda d: d["chunks"][0].update(hash="ab" * 31))
    yield "missing tensors", edit(lambda d: d.pop("tensors"))
    yield "missing chunk codec", edit(lambda d: d["chunks"][0].pop("codec"))
    yield "unknown codec", edit(lambda d: d["chunks"][0].update(codec="lz4"))
    yield "unknown dtype", edit(lambda d: d["tensors"][0].update(dtype="qint8"))
    yield "two-element piece", edit(lambda d: d["tensors"][0]["shards"][0].update(pieces=[[0, 0]]))
    yield "negative dim", edit(lambda d: d["tensors"][0].update(shape=[-1]))
    yield "no shards", edit(lambda d: d["tensors"][0].update(shards=[]))
    yield "empty key", edit(lambda d: d["tensors"][0].update(key=""))
    yield "traversal name", edit(lambda d: d.update(name="../etc"))
    yield "reserved name", edit(lambda d: d.update(name="chunks"))
    yield "major version 3", edit(lambda d: d.update(version=[3, 0]))
    yield "state not bin", edit(lambda d: d.update(state=[]))
    yield "wrong format", edit(lambda d: d.update(format="safetensors"))


def test_broken_documents_fail_the_schemas(saved):
    repo, _ = saved
    manifest_validator = _validator("manifest.schema.json")
    manifest = unpack(_manifest_bytes(repo, "plain"))
    good, rows = json_image(manifest), json_image(tensor_rows(manifest["tensors"]))
    chunks = json_image(chunk_rows(manifest["chunks"]))
    manifest_validator.validate(good)
    manifest_validator.validate({**good, "tensors": rows, "chunks": chunks})
    for what, bad in _bad_manifests(good, rows, chunks):
        assert not manifest_validator.is_valid(bad), what

    commit_validator = _validator("commit.schema.json")
    commit = json.loads((repo / "plain" / "COMMIT").read_bytes())
    for what, change in [
        ("bad manifest hash", {"manifest": "not-a-hash"}),
        ("size 0", {"manifest_size": 0}),
        ("string step", {"step": "3"}),
        ("fractional step", {"step": 3.5}),
        ("bool size", {"manifest_size": True}),
        ("traversal parent", {"parent": "a/b"}),
        ("major 3", {"version": [3, 0]}),
    ]:
        assert not commit_validator.is_valid({**commit, **change}), what
    assert not commit_validator.is_valid({k: v for k, v in commit.items() if k != "manifest"})

    marker_validator = _validator("repository.schema.json")
    assert not marker_validator.is_valid({"format": "ckptfmt-repository"})
    assert not marker_validator.is_valid({"format": "ckptfmt-repository", "version": [3, 0]})
    assert marker_validator.is_valid({"format": "ckptfmt-repository", "version": [1, 7], "future": True})


# -- a reader written from FORMAT.md alone ------------------------------------















@pytest.mark.parametrize("name", ["plain", "packed-z"])
def test_independent_reader_reassembles_every_tensor(saved, name):
    repo, state = saved
    reader = SpecReader(repo, name)
    for key, value in _tensor_leaves(state).items():
        entry, data = reader.tensor_bytes(key)
        assert data == _expected_bytes(value), key
        assert list(entry["shape"]) == list(value.shape)
    assert reader.chunks_read == len(reader.chunks)  # every chunk was read and hashed

    entry = next(t for t in reader.tensors if t["key"] == "model/bias")
    assert entry["kind"] == "parameter" and entry["requires_grad"] is True
    assert next(t for t in reader.tensors if t["key"] == "np")["kind"] == "numpy"
    assert next(t for t in reader.tensors if t["key"] == "model/big_bf16")["dtype"] == "bfloat16"

    tree = msgpack.unpackb(reader.manifest["state"], raw=False, strict_map_key=False, ext_hook=tree_hook)
    assert tree["step"] == 3
    assert set(tree["layers"]) == {0, 1}  # int map keys stay ints
    index = tree["layers"][1][1]
    assert tree["layers"][1][0] == "<tensor>" and reader.tensors[index]["key"] == "layers/1"
    assert tree["misc"][:2] == (1, 2**70) and math.isnan(tree["misc"][2])
    if name == "plain":
        user = msgpack.unpackb(reader.manifest["user"], raw=False, strict_map_key=False)
        assert user == {"lr": 0.001, 7: "seven"}


def test_independent_reader_detects_a_corrupt_chunk(saved, tmp_path):
    repo, _ = saved
    copy_root = tmp_path / "repo"
    shutil.copytree(repo, copy_root)
    reader = SpecReader(copy_root, "plain")
    row = next(c for c in reader.chunks if c["size"] == CHUNK_SIZE)
    path = copy_root / "chunks" / row["hash"][:2] / row["hash"]
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="corrupt"):
        reader.tensor_bytes("model/big")
    with pytest.raises(ckptfmt.CorruptDataError):
        ckptfmt.open(f"{copy_root}/plain").get_tensor("model/big")


def test_shuffle_matches_the_spec_example():
    data = bytes(range(11))
    assert shuffle(data, 4).hex(" ") == "00 04 01 05 02 06 03 07 08 09 0a"
    assert unshuffle(shuffle(data, 4), 4) == data


# -- a writer written from FORMAT.md alone, read by ckptfmt --------------------





def test_checkpoint_written_from_the_spec_is_read_by_ckptfmt(tmp_path):
    repo = tmp_path / "handmade"
    repo.mkdir()
    (repo / "ckptfmt.json").write_text(json.dumps({"format": "ckptfmt-repository", "version": [1, 0]}))
    expected = write_by_spec(repo, "by-hand")

    _validator("repository.schema.json").validate(json.loads((repo / "ckptfmt.json").read_text()))
    _validator("commit.schema.json").validate(json.loads((repo / "by-hand" / "COMMIT").read_text()))
    _validator("manifest.schema.json").validate(json_image(unpack(_manifest_bytes(repo, "by-hand"))))

    state = ckptfmt.load(f"{repo}/by-hand")
    assert torch.equal(state["grid"], torch.from_numpy(expected["grid"]))
    assert state["again"] is state["grid"]
    assert state["n"].shape == () and state["n"].dtype == torch.int64 and int(state["n"]) == -5
    assert state["t"] == (1, 2.5) and type(state["t"]) is tuple
    assert state[7] == "seven"
    with ckptfmt.open(f"{repo}/by-hand") as ckpt:
        assert ckpt.tensor_info("grid").shards[0].rank == 1
        assert ckpt.metadata["extra"] == {"a_field_from_a_future_minor": {"ignored": True}}
    assert ckptfmt.verify(str(repo)).ok

    # ...and the spec reader agrees with the spec writer.
    reader = SpecReader(repo, "by-hand")
    assert reader.tensor_bytes("grid")[1] == expected["grid"].tobytes()
    assert reader.tensor_bytes("grid_again")[1] == expected["grid"].tobytes()
    assert reader.tensor_bytes("n")[1] == np.array(-5, dtype="<i8").tobytes()


# -- delta chunks (FORMAT.md 4.1, 5.5): the reader follows the key the text gives ------------

#: Tensors of every element size a delta codec shuffles by (16-byte elements: delta1), each over
#: 256 KiB so that it is cut into chunks of its own, and a small one that goes into a pack.
DELTA_DTYPES = {"i8": torch.int8, "bf16": torch.bfloat16, "f32": torch.float32, "f64": torch.float64,
                "c128": torch.complex128}


def delta_run(repo: Path, saves: int, compression: str = "delta-zstd") -> list[dict]:
    """``saves`` checkpoints ``s0``, ``s1``, ... of a state that changes a little each time, saved with
    ``compression``; returns each save's state (copies)."""
    gen = torch.Generator().manual_seed(27)
    state = {key: (torch.randint(-100, 100, (320_000,), generator=gen, dtype=torch.int8) if dtype == torch.int8
                   else torch.randn(320_000 // torch.empty(0, dtype=dtype).element_size(), generator=gen,
                                    dtype=torch.float64).to(dtype))
             for key, dtype in DELTA_DTYPES.items()}
    state["small"] = torch.arange(10.0)
    saved = []
    for step in range(saves):
        for key, tensor in state.items():
            if tensor.dtype == torch.int8:
                tensor[step::997] += 1
            elif key != "small":
                tensor += (torch.randn(tensor.shape, generator=gen, dtype=torch.float64) * 1e-5).to(tensor.dtype)
        state["small"] += 1
        ckptfmt.save(state, f"{repo}/s{step}", compression=compression, chunk_size=2**17)
        saved.append({key: tensor.clone() for key, tensor in state.items()})
    return saved


def _depth(chunks: list[dict], row: int) -> int:
    depth = 0
    while "base" in chunks[row]:
        row, depth = chunks[row]["base"], depth + 1
    return depth


def test_independent_reader_reads_delta_chains_of_every_element_size_bit_exactly(tmp_path):
    repo = tmp_path / "repo"
    saved = delta_run(repo, 10)
    depths, codecs = set(), set()
    for step, state in enumerate(saved):
        reader = SpecReader(repo, f"s{step}")
        for key, value in state.items():
            assert reader.tensor_bytes(key)[1] == _expected_bytes(value), (step, key)
        depths |= {_depth(reader.chunks, row) for row in range(len(reader.chunks))}
        codecs |= {row["codec"] for row in reader.chunks}
        _validator("manifest.schema.json").validate(json_image(reader.manifest))
    assert depths == set(range(9))  # chains 1 to 8 deep (ckptfmt stacks at most 8 deltas)
    assert {"delta1-zstd", "delta2-zstd", "delta4-zstd", "delta8-zstd"} <= codecs


def test_a_delta_chunk_written_from_the_spec_is_read_by_ckptfmt(tmp_path):
    """The text's writer stores a delta chunk at the key 4.1 gives, against a base no piece names."""
    repo = tmp_path / "handmade"
    repo.mkdir()
    (repo / "ckptfmt.json").write_text(json.dumps({"format": "ckptfmt-repository", "version": [1, 6]}))
    expected = write_by_spec(repo, "by-hand")
    manifest_path = next((repo / "by-hand").glob("manifest-*.msgpack"))
    doc = unpack(manifest_path.read_bytes())
    reader = SpecReader(repo, "by-hand")
    old = bytearray(reader.chunk(1))
    old[0] ^= 0x40  # the base: the chunk as a previous checkpoint held it, then named by no piece
    base_row = store_chunk(repo, bytes(old), "shuffle4-zstd")
    doc["chunks"].append(base_row)
    doc["chunks"][1] = store_chunk(repo, reader.chunk(1), "delta4-zstd",
                                   (len(doc["chunks"]) - 1, base_row, bytes(old)))
    data = msgpack.packb(doc, use_bin_type=True)
    digest = blake3_hex(data)
    manifest_path.unlink()
    (repo / "by-hand" / f"manifest-{digest}.msgpack").write_bytes(data)
    commit = json.loads((repo / "by-hand" / "COMMIT").read_text())
    (repo / "by-hand" / "COMMIT").write_text(json.dumps({**commit, "manifest": digest, "manifest_size": len(data)}))
    key = f"chunks/{doc['chunks'][1]['hash'][:2]}/{doc['chunks'][1]['hash']}.delta4-zstd.{base_row['hash']}"
    assert (repo / key).is_file()
    assert torch.equal(ckptfmt.load(f"{repo}/by-hand")["grid"], torch.from_numpy(expected["grid"]))
    assert ckptfmt.verify(str(repo)).ok
    assert SpecReader(repo, "by-hand").tensor_bytes("grid")[1] == expected["grid"].tobytes()
