"""Writes spec/conformance/: small checkpoints and hostile variants of them, each with what a reader must do.

``.venv/bin/python -m tests.support.make_conformance`` replaces spec/conformance/repos/ and cases.json.
The accepted checkpoints are written by ckptfmt's own ``save`` (one per layout and codec family: maps and
columns, packs, every codec of format 2.0, deltas, shard grids, a format-1.6 floor, a signature), then
slimmed: the optional run metadata (environment, timing, RNG states) is dropped from each manifest and
the commit index from the repository, so that the suite stays small; every other byte is the writer's.
What each tensor must read as is taken from the values given to ``save``, never from a reader. Each
refused case is an accepted one with one thing broken, re-hashed where needed so that the reader meets
that thing and not an earlier check. The parity cases (spec 5.6) are the ``parity`` repository, protected by
``ckptfmt.protect`` once slimmed, with objects lost (what a repairer rebuilds, each object's sha256 taken
from the bytes before the damage) or with more lost than parity rebuilds, or a hostile parity record.
tests/format/test_conformance.py runs ckptfmt and tests/support/spec_reader.py over the result.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import blake3
import msgpack
import torch

import ckptfmt
from tests.corpus import typed_json
from tests.corpus.typed_json import describe_tensor

sys.modules.setdefault("typed_json", typed_json)  # tests/corpus/writer.py runs as a script beside it
from tests.corpus.writer import big_tensors

ROOT = Path(__file__).resolve().parents[2] / "spec" / "conformance"
KEY = "keys/conformance-test-key.pem"
#: The run metadata a slimmed manifest goes without (spec 9: optional).
SLIMMED = ("environment", "timing", "rng")
Tensors = dict[str, torch.Tensor]


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def json_image(value):
    """The JSON image of msgpack data (spec 15)."""
    from tests.support.spec_reader import json_image as image
    return image(value)


# -- the accepted checkpoints -----------------------------------------------------------------------------

def basic_state() -> tuple[dict, Tensors]:
    """Maps and packs: small tensors of several dtypes, a tied alias, plain values of many kinds."""
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4
    tensors = {"w": w, "b": torch.tensor([1.5, -2.0, 0.0, -0.0], dtype=torch.bfloat16),
               "mask": torch.tensor([True, False, True]), "n": torch.tensor(-5, dtype=torch.int64),
               "empty": torch.zeros(0, 3, dtype=torch.float16), "w_tied": w}
    plain = {"lr": 3e-4, "name": "run", "steps": [1, 2, 3], "big": 2**70, "tuple": (1, None, True),
             "bytes": b"\x00\xff", 7: "seven", "nested": {"a": {"b": [0.5, float("inf")]}}}
    return {**tensors, **plain}, tensors


def shard_state() -> tuple[dict, Tensors]:
    """A 4x6 tensor as a 2x2 shard grid (the grid columns) and a 4x4 one in three shards that make no grid."""
    whole = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    grid = ckptfmt.Sharded(whole.shape, [ckptfmt.Shard((r, c), whole[r:r + 2, c:c + 3].clone(), rank)
                                         for rank, (r, c) in enumerate((r, c) for r in (0, 2) for c in (0, 3))])
    rows = torch.arange(16, dtype=torch.int32).reshape(4, 4)
    uneven = ckptfmt.Sharded(rows.shape, [ckptfmt.Shard((0, 0), rows[:2, :2].clone(), 0),
                                          ckptfmt.Shard((0, 2), rows[:2, 2:].clone(), 1),
                                          ckptfmt.Shard((2, 0), rows[2:].clone(), 2)])
    return {"grid": grid, "rows": uneven}, {"grid": whole, "rows": rows}


def codec_state(changed: bool) -> tuple[dict, Tensors]:
    """Tensors of 256 KiB of each element width (tests/corpus/writer.py's), a small one packed."""
    tensors = {f"big/{name}": tensor for name, tensor in big_tensors(changed).items()}
    tensors["small"] = torch.arange(10.0)
    return {"big": {key.removeprefix("big/"): t for key, t in tensors.items() if key.startswith("big/")},
            "small": tensors["small"]}, tensors


def parity_state() -> tuple[dict, Tensors]:
    """A float32 tensor of 256 KiB (smaller ones are packed, spec 5.2) cut at 32 KiB into eight chunks of
    repeating values that shuffle4-zstd stores in a few hundred bytes each (none alike), and a pack: with the
    manifest, ten protected objects of different sizes, so that 3+2 parity makes three stripes of three pieces
    and one of a single piece (its other places zeros, spec 5.6)."""
    g = torch.Generator().manual_seed(5)
    parts = [torch.randint(-64, 64, (32 * (i + 1),), generator=g).repeat(8192 // (32 * (i + 1)) + 1)[:8192]
             for i in range(8)]
    tensors = {"big": (torch.cat(parts) * 0.125).to(torch.float32), "w": torch.randn(8, 16, generator=g),
               "n": torch.tensor(-5), "h": torch.arange(12, dtype=torch.bfloat16)}
    return {**tensors, "step": 7}, tensors


#: The parity every parity case carries (spec 5.6), added by ``ckptfmt.protect`` once the checkpoint is slimmed.
PARITY = "3+2"

#: name -> (checkpoints in order: (name, state builder, save options)), what the case shows.
ACCEPTED: dict[str, tuple[list[tuple[str, Callable, dict]], str]] = {
    "basic": ([("step-1", basic_state, {})],
              "tensor and chunk tables in columns, a pack (codec none), a tied alias, an empty tensor, plain "
              "values of many kinds"),
    "shards": ([("step-1", shard_state, {})],
               "a shard grid in the tensor columns (a nil item of rows, spec 6.12) and shards in a map"),
    "shuffle": ([("step-1", lambda: codec_state(False), {"compression": "shuffle-zstd"})],
                "codecs zstd, shuffle2-zstd, shuffle4-zstd, shuffle8-zstd"),
    "float": ([("step-1", lambda: codec_state(False), {"compression": "float-zstd"})],
              "codecs float2-zstd, float4-zstd, float8-zstd"),
    "delta": ([("step-1", lambda: codec_state(False), {"compression": "shuffle-zstd"}),
               ("step-2", lambda: codec_state(True), {"compression": "delta-zstd"})],
              "step-2: codecs delta1-zstd ... delta8-zstd against step-1's chunks (rows with a base)"),
    "float-delta": ([("step-1", lambda: codec_state(False), {"compression": "float-zstd"}),
                     ("step-2", lambda: codec_state(True), {"compression": "auto"})],
                    "step-2: codecs floatdelta2/4/8-zstd against step-1's chunks"),
    "rows-1.6": ([("step-1", basic_state, {"format_version": "1.6"}),
                  ("step-2", shard_state, {"format_version": "1.6"})],
                 "format 1.6: tensor and chunk tables as arrays of maps, a shard grid of 1.6 in a map"),
    "signed": ([("step-1", basic_state, {})],
               "signed by keys/conformance-test-key.pem (Ed25519): accepted when that key is trusted"),
    "parity": ([("step-1", parity_state, {"chunk_size": 32768, "compression": "shuffle-zstd"})],
               f"protected by {PARITY} parity (spec 5.6, format 2.1): a reader reads it as if it had none; the "
               "parity cases below are this repository with objects lost"),
}


def write_accepted(name: str, repos: Path, key: Path) -> list[dict]:
    """Save the case's checkpoints, slim them, and describe what a reader must find."""
    repo = repos / name
    checkpoints, what = ACCEPTED[name]
    expected = []
    for step, (checkpoint, build, options) in enumerate(checkpoints, start=1):
        state, tensors = build()
        ckptfmt.save(state, repo / checkpoint, step=step, rng=[], metadata={"case": name}, **options)
        expected.append((checkpoint, tensors))
    slim(repo)
    if name == "signed":
        ckptfmt.sign(repo / "step-1", key)
    if name == "parity":
        ckptfmt.protect(repo, PARITY)
        shutil.rmtree(repo / "_leases", ignore_errors=True)
    cases = []
    for checkpoint, tensors in expected:
        manifest = read_manifest(repo, checkpoint)
        case = {"name": name if len(checkpoints) == 1 else f"{name}/{checkpoint}", "repository": f"repos/{name}",
                "checkpoint": checkpoint, "what": what, "expect": "accept",
                "tensors": {key: _tensor(tensor) for key, tensor in tensors.items()},
                "metadata": {field: manifest.get(field) for field in
                             ("format", "version", "requires", "name", "step", "parent", "created_ns")},
                "codecs": sorted({row for row in _codecs(manifest)}),
                "state": json_image(unpack(manifest["state"])),
                "user": json_image(unpack(manifest["user"]))}
        if name == "signed":
            case["trusted_keys"] = [KEY + ".pub"]
        cases.append(case)
    return cases


def _tensor(tensor: torch.Tensor) -> dict:
    found = describe_tensor(tensor)
    return {"dtype": found["dtype"], "shape": found["shape"], "sha256": found["sha256"]}


def _codecs(manifest: dict) -> list[str]:
    chunks = manifest["chunks"]
    if isinstance(chunks, dict):  # columns (spec 6.13)
        return list(chunks["codecs"])
    return [row["codec"] for row in chunks]


# -- editing a repository by hand -------------------------------------------------------------------------

def slim(repo: Path) -> None:
    """Drop the optional run metadata from every manifest and the commit index from the repository."""
    marker = json.loads((repo / "ckptfmt.json").read_bytes())
    marker.pop("index", None)
    (repo / "ckptfmt.json").write_text(json.dumps(marker))
    shutil.rmtree(repo / "_index", ignore_errors=True)
    shutil.rmtree(repo / "_leases", ignore_errors=True)
    for commit in sorted(repo.glob("*/COMMIT")):
        edit_manifest(repo, commit.parent.name, lambda doc: [doc.pop(field, None) for field in SLIMMED])


def read_manifest(repo: Path, name: str) -> dict:
    record = json.loads((repo / name / "COMMIT").read_bytes())
    return unpack((repo / name / f"manifest-{record['manifest']}.msgpack").read_bytes())


def edit_manifest(repo: Path, name: str, change: Callable[[dict], object], *, rehash: bool = True,
                  encode: Callable[[dict], bytes] | None = None) -> None:
    """Change checkpoint ``name``'s manifest; with ``rehash``, the commit record then names the new bytes
    (so that a reader meets the change, not a hash mismatch)."""
    record = json.loads((repo / name / "COMMIT").read_bytes())
    old = repo / name / f"manifest-{record['manifest']}.msgpack"
    doc = unpack(old.read_bytes())
    change(doc)
    data = (encode or (lambda d: msgpack.packb(d, use_bin_type=True)))(doc)
    if not rehash:
        old.write_bytes(data)
        return
    old.unlink()
    digest = blake3.blake3(data).hexdigest()
    (repo / name / f"manifest-{digest}.msgpack").write_bytes(data)
    edit_commit(repo, name, lambda rec: rec.update(manifest=digest, manifest_size=len(data)))


def edit_commit(repo: Path, name: str, change: Callable[[dict], object]) -> None:
    path = repo / name / "COMMIT"
    record = json.loads(path.read_bytes())
    change(record)
    path.write_text(json.dumps(record))


def edit_marker(repo: Path, change: Callable[[dict], object]) -> None:
    path = repo / "ckptfmt.json"
    marker = json.loads(path.read_bytes())
    change(marker)
    path.write_text(json.dumps(marker))


def chunk_files(repo: Path, codec: str | None = None) -> list[Path]:
    """The repository's chunk objects, by name; ``codec``: those stored with it only ('none': no suffix)."""
    found = sorted(p for p in (repo / "chunks").rglob("*") if p.is_file())
    if codec is None:
        return found
    return [p for p in found if (p.name.split(".")[1] if "." in p.name else "none") == codec]


def flip_byte(path: Path, at: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


# -- the refused variants ---------------------------------------------------------------------------------

def read_column(data: bytes, count: int) -> list[int]:
    """A column of spec 6.11: ``count`` unsigned little-endian integers of one width."""
    width = len(data) // count if count else 1
    return [int.from_bytes(data[width * i:width * i + width], "little") for i in range(count)]


def write_column(values: list[int]) -> bytes:
    """A column of spec 6.11 in the narrowest width that holds every value."""
    width = next(w for w in (1, 2, 4, 8) if max(values, default=0) < 2 ** (8 * w))
    return b"".join(v.to_bytes(width, "little") for v in values)


def edit_column(table: dict, name: str, count: int, change: Callable[[list[int]], object]) -> None:
    values = read_column(table[name], count)
    change(values)
    table[name] = write_column(values)


def _tensor_columns(change: Callable[[dict], object]) -> Callable[[dict], object]:
    return lambda doc: change(doc["tensors"])


def _tensor_column(name: str, change: Callable[[list[int]], object], *, dims: bool = False):
    """Change one column of the tensor columns (``dims``: the column of all shapes' dimensions)."""
    def edit(table: dict) -> None:
        entries = len(table["key"])
        count = sum(read_column(table["ndim"], entries)) if dims else entries
        edit_column(table, name, count, change)
    return _tensor_columns(edit)


def _chunk_column(name: str, change: Callable[[list[int]], object]):
    return lambda doc: edit_column(doc["chunks"], name, len(doc["chunks"]["hash"]) // 32, change)


def _duplicate_key(doc: dict) -> bytes:
    """The manifest with its ``name`` field written twice (a map's keys are unique, spec 6.1)."""
    body = b"".join(msgpack.packb(k, use_bin_type=True) + msgpack.packb(v, use_bin_type=True)
                    for k, v in [*doc.items(), ("name", doc["name"])])
    return b"\xdf" + struct.pack(">I", len(doc) + 1) + body


#: name -> (case it breaks, (problem, when), what is wrong, how to break it: a function of the repository).
REFUSED: dict[str, tuple[str, tuple[str, str], str, Callable[[Path], object]]] = {
    "chunk-flipped-byte": ("basic", ("corrupt-data", "read"), "a chunk's bytes do not hash to its name",
                           lambda repo: flip_byte(chunk_files(repo, "none")[0], 3)),
    "chunk-missing": ("basic", ("missing-object", "read"), "a chunk the manifest names is absent",
                      lambda repo: chunk_files(repo, "none")[0].unlink()),
    "chunk-longer": ("basic", ("corrupt-data", "read"), "a chunk object is longer than its stored_size",
                     lambda repo: chunk_files(repo, "none")[0].open("ab").write(b"\x00")),
    "zstd-truncated": ("shuffle", ("corrupt-data", "read"), "a zstd frame cut short (stored_size rewritten)",
                       lambda repo: _truncate_chunk(repo, "shuffle4-zstd")),
    "float-plane-lengths": ("float", ("corrupt-data", "read"),
                            "a float chunk's plane lengths do not add up to its stored size (spec 5.3)",
                            lambda repo: _bad_plane_lengths(repo)),
    "delta-base-flipped": ("delta", ("corrupt-data", "read"),
                           "step-2: a delta chunk's base is damaged, so the delta does not decode to its hash",
                           lambda repo: flip_byte(_a_base_of(repo, "step-2"), 12)),
    "manifest-flipped-byte": ("basic", ("corrupt-data", "open"), "the manifest's bytes differ from its hash",
                              lambda repo: edit_manifest(repo, "step-1", lambda d: d.update(user=b"\x80"),
                                                         rehash=False)),
    "manifest-size": ("basic", ("corrupt-data", "open"), "the commit record's manifest_size is wrong",
                      lambda repo: edit_commit(repo, "step-1",
                                               lambda r: r.update(manifest_size=r["manifest_size"] + 1))),
    "commit-name": ("basic", ("invalid-manifest", "open"), "the commit record names another checkpoint",
                    lambda repo: edit_commit(repo, "step-1", lambda r: r.update(name="step-2"))),
    "manifest-version-3": ("basic", ("unsupported-version", "open"),
                           "the manifest is format 3.0: a newer major, refused with 'upgrade'",
                           lambda repo: edit_manifest(repo, "step-1", lambda d: d.update(version=[3, 0]))),
    "commit-version-3": ("basic", ("unsupported-version", "open"), "the commit record is format 3.0",
                         lambda repo: edit_commit(repo, "step-1", lambda r: r.update(version=[3, 0]))),
    "marker-version-3": ("basic", ("unsupported-version", "open"),
                         "the repository marker is format 3.0: refused before any checkpoint is read",
                         lambda repo: edit_marker(repo, lambda m: m.update(version=[3, 0]))),
    "unknown-required-feature": ("basic", ("unsupported-version", "open"),
                                 "the manifest requires a feature no reader knows (spec 13.2)",
                                 lambda repo: edit_manifest(repo, "step-1", lambda d: d.update(
                                     requires=sorted([*d["requires"], "teleportation"])))),
    "marker-unknown-feature": ("basic", ("unsupported-version", "open"),
                               "the marker requires a feature no reader knows (spec 10.2, 13.2)",
                               lambda repo: edit_marker(repo, lambda m: m.update(requires=["teleportation"]))),
    "undeclared-feature": ("basic", ("invalid-manifest", "open"),
                           "a format-2.0 manifest uses tensor columns without declaring tensor-columns",
                           lambda repo: edit_manifest(repo, "step-1", lambda d: d.update(
                               requires=[f for f in d["requires"] if f != "tensor-columns"]))),
    "unknown-codec": ("basic", ("invalid-manifest", "open"), "a chunk's codec is not one of spec 5.3",
                      lambda repo: edit_manifest(repo, "step-1", lambda d: d["chunks"].__setitem__(
                          "codecs", ["lz4", *d["chunks"]["codecs"][1:]]))),
    "unknown-dtype": ("basic", ("invalid-manifest", "open"), "a tensor's dtype is not one of spec 8",
                      lambda repo: edit_manifest(repo, "step-1", _tensor_columns(
                          lambda t: t.__setitem__("dtypes", ["float33", *t["dtypes"][1:]])))),
    "duplicate-tensor-key": ("basic", ("invalid-manifest", "open"), "two tensors have one key",
                             lambda repo: edit_manifest(repo, "step-1", _tensor_columns(
                                 lambda t: t.__setitem__("key", [t["key"][0]] * len(t["key"]))))),
    "piece-past-chunk": ("basic", ("invalid-manifest", "open"), "a piece runs past its chunk's decoded size",
                         lambda repo: edit_manifest(repo, "step-1", _tensor_column(
                             "offset", lambda offsets: offsets.__setitem__(0, 250)))),
    "shape-too-large": ("basic", ("invalid-manifest", "open"),
                        "a tensor's byte size is over 2^48 (spec 14), checked before any allocation",
                        lambda repo: edit_manifest(repo, "step-1", _tensor_column(
                            "dims", lambda dims: dims.__setitem__(slice(0, 2), [2**40, 2**40]), dims=True))),
    "shards-overlap": ("rows-1.6", ("invalid-manifest", "open"),
                       "step-2: two shards of a tensor overlap (spec 6.5)",
                       lambda repo: edit_manifest(repo, "step-2", _overlap_shards)),
    "delta-base-itself": ("delta", ("invalid-manifest", "open"), "step-2: a delta row is its own base (spec 5.5)",
                          lambda repo: edit_manifest(repo, "step-2", _chunk_column("base", _self_base))),
    "stats-column-missing": ("basic", ("invalid-manifest", "open"),
                             "the statistics columns lack posinf (all ten are required, spec 6.12)",
                             lambda repo: edit_manifest(repo, "step-1", _tensor_columns(
                                 lambda t: t["stats"].pop("posinf")))),
    "tensor-reference-out-of-range": ("basic", ("invalid-manifest", "read"),
                                      "the value tree names tensor 99 of a table of 6 (spec 7.2)",
                                      lambda repo: edit_manifest(repo, "step-1", lambda d: d.update(
                                          state=msgpack.packb({"t": msgpack.ExtType(1, msgpack.packb(99))},
                                                              use_bin_type=True)))),
    "manifest-key-twice": ("basic", ("invalid-manifest", "open"), "the manifest map has the key 'name' twice",
                           lambda repo: edit_manifest(repo, "step-1", lambda d: None, encode=_duplicate_key)),
    "signature-forged": ("signed", ("signature", "open"),
                         "the trusted key's signature does not verify (its bytes changed)",
                         lambda repo: _forge_signature(repo)),
}


def _truncate_chunk(repo: Path, codec: str) -> None:
    """Cut a chunk's frame short and rewrite the stored_size the manifest records, so that the frame is met."""
    path = chunk_files(repo, codec)[0]
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    digest = path.name.split(".")[0]

    def change(doc: dict) -> None:
        hashes = doc["chunks"]["hash"]
        index = [hashes[i:i + 32].hex() for i in range(0, len(hashes), 32)].index(digest)
        _chunk_column("stored_size", lambda sizes: sizes.__setitem__(index, len(data) // 2))(doc)
    edit_manifest(repo, "step-1", change)


def _bad_plane_lengths(repo: Path) -> None:
    path = chunk_files(repo, "float4-zstd")[0]
    data = bytearray(path.read_bytes())
    first = int.from_bytes(data[:8], "little")
    data[:8] = (first - 1).to_bytes(8, "little")
    data[8:16] = (int.from_bytes(data[8:16], "little") + 1).to_bytes(8, "little")
    path.write_bytes(bytes(data))


def _a_base_of(repo: Path, name: str) -> Path:
    """The stored object of a chunk some delta chunk of checkpoint ``name`` is stored against."""
    delta = next(p for p in chunk_files(repo) if p.name.count(".") == 2)
    base = delta.name.split(".")[2]
    return next(p for p in chunk_files(repo) if p.name.split(".")[0] == base)


def _overlap_shards(doc: dict) -> None:
    entry = next(t for t in doc["tensors"] if t["key"] == "rows")
    entry["shards"][1]["offsets"][1] = 1  # [0, 1]: its first column is the first shard's second


def _self_base(bases: list[int]) -> None:
    row = next(i for i, b in enumerate(bases) if b)
    bases[row] = row + 1  # base b > 0 names row b - 1: this row


def _forge_signature(repo: Path) -> None:
    path = next((repo / "step-1").glob("signature-*.json"))
    doc = json.loads(path.read_bytes())
    raw = bytearray(base64.b64decode(doc["signature"]))
    raw[0] ^= 0x01
    doc["signature"] = base64.b64encode(bytes(raw)).decode("ascii")
    path.write_text(json.dumps(doc))


# -- the parity cases (spec 5.6) ---------------------------------------------------------------------------

def parity_record(repo: Path, name: str = "step-1") -> dict:
    """Checkpoint ``name``'s parity record, the one its commit record names."""
    digest = json.loads((repo / name / "COMMIT").read_bytes())["parity"]
    return unpack((repo / name / f"parity-{digest}.msgpack").read_bytes())


def parity_path(repo: Path, digest: str, place: int) -> Path:
    return repo / "_parity" / digest[:2] / f"{digest}.{place}"


def _stripe(doc: dict, *, manifest: bool, full: bool = True) -> list:
    """The first stripe that holds the manifest (``manifest``) or not, of K pieces (``full``) or fewer."""
    return next(s for s in doc["stripes"] if any(doc["objects"][p[0]].endswith(".msgpack") for p in s[1]) == manifest
                and (len(s[1]) == doc["k"]) == full)


def _chunks_of(doc: dict, stripe: list) -> list[Path]:
    return [Path(doc["objects"][obj]) for obj, _, _ in stripe[1] if not doc["objects"][obj].endswith(".msgpack")]


def _lose(repo: Path, keys) -> None:
    for key in keys:
        (repo / key).unlink()


def _lose_chunks(repo: Path, count: int, *, stripe: int = 0) -> None:
    """``count`` chunks of the ``stripe``-th stripe of K chunks deleted."""
    doc = parity_record(repo)
    full = [s for s in doc["stripes"] if len(s[1]) == doc["k"] and not any(
        doc["objects"][p[0]].endswith(".msgpack") for p in s[1])]
    _lose(repo, _chunks_of(doc, full[stripe])[:count])


def _damage_chunks(repo: Path) -> None:
    """In a stripe of K chunks, one chunk with a byte flipped (its size right: only decoding and hashing it
    finds it) and one cut short; and the single piece of the stripe with fewer than K pieces deleted."""
    doc = parity_record(repo)
    full = [s for s in doc["stripes"] if len(s[1]) == doc["k"] and not any(
        doc["objects"][p[0]].endswith(".msgpack") for p in s[1])]
    flipped, cut = _chunks_of(doc, full[1])[:2]
    flip_byte(repo / flipped, (repo / flipped).stat().st_size // 2)
    (repo / cut).write_bytes((repo / cut).read_bytes()[:-5])
    _lose(repo, _chunks_of(doc, _stripe(doc, manifest=False, full=False)))


def _lose_manifest_and_chunk(repo: Path) -> None:
    doc = parity_record(repo)
    stripe = _stripe(doc, manifest=True)
    _lose(repo, [f"step-1/manifest-{doc['manifest']}.msgpack", _chunks_of(doc, stripe)[0]])


def _damage_parity(repo: Path) -> None:
    """The manifest's stripe: a parity object with a byte flipped and a chunk deleted; another stripe: a
    parity object cut short (rebuilt from its data pieces alone)."""
    doc = parity_record(repo)
    stripe = _stripe(doc, manifest=True)
    flip_byte(parity_path(repo, stripe[2][0], 0), 7)
    _lose(repo, _chunks_of(doc, stripe)[:1])
    other = _stripe(doc, manifest=False)
    path = parity_path(repo, other[2][1], 1)
    path.write_bytes(path.read_bytes()[:-1])


def _lose_folder(repo: Path) -> None:
    shutil.rmtree(repo / "step-1")


def _too_many(repo: Path) -> None:
    """M chunks of a stripe deleted and one of its parity objects damaged: M+1 of its pieces lost."""
    doc = parity_record(repo)
    full = [s for s in doc["stripes"] if len(s[1]) == doc["k"] and not any(
        doc["objects"][p[0]].endswith(".msgpack") for p in s[1])]
    _lose(repo, _chunks_of(doc, full[0])[:doc["m"]])
    flip_byte(parity_path(repo, full[0][2][1], 1), 3)


def _uncommitted(repo: Path) -> None:
    """What a save killed before its commit leaves (spec 5.6): the folder's record, no commit record, no copy
    of the record outside the folder."""
    (repo / "step-1" / "COMMIT").unlink()
    shutil.rmtree(repo / "_parity" / "records")


def replace_record(repo: Path, change: Callable[[dict], object], *, rehash: bool = True) -> None:
    """Change the parity record; with ``rehash``, it is stored under its new hash (folder and M copies) and
    the commit record names it, so that a repairer meets the change, not a hash mismatch; without, the new
    bytes replace every copy under the old name."""
    commit = json.loads((repo / "step-1" / "COMMIT").read_bytes())
    old = commit["parity"]
    doc = parity_record(repo)
    change(doc)
    data = msgpack.packb(doc, use_bin_type=True)
    paths = [repo / "step-1" / f"parity-{old}.msgpack", *sorted((repo / "_parity" / "records" / "step-1").iterdir())]
    digest = blake3.blake3(data).hexdigest() if rehash else old
    for path in paths:
        path.unlink()
        path.with_name(path.name.replace(old, digest)).write_bytes(data)
    edit_commit(repo, "step-1", lambda r: r.update(parity=digest))


def _stripe_of(doc: dict, obj: int) -> list:
    return next(s for s in doc["stripes"] if any(p[0] == obj for p in s[1]))


def _a_lost_chunk(repo: Path) -> int:
    """A chunk of a stripe of K chunks deleted (its index in the record): a good record rebuilds it."""
    doc = parity_record(repo)
    full = [s for s in doc["stripes"] if len(s[1]) == doc["k"] and not any(
        doc["objects"][p[0]].endswith(".msgpack") for p in s[1])]
    obj = full[0][1][0][0]
    _lose(repo, [doc["objects"][obj]])
    return obj


def _hostile(change: Callable[[dict, int], object], *, rehash: bool = True) -> Callable[[Path], None]:
    """A chunk lost (index ``obj`` in the record), then the record changed by ``change(doc, obj)``."""
    def damage(repo: Path) -> None:
        obj = _a_lost_chunk(repo)
        replace_record(repo, lambda doc: change(doc, obj), rehash=rehash)
    return damage


def _piece_past_object(doc: dict, obj: int) -> None:
    stripe = _stripe_of(doc, doc["stripes"][0][1][0][0])
    piece = stripe[1][-1]
    piece[2] = doc["sizes"][piece[0]] + 1  # within the stripe's length, one byte past its object's end
    assert piece[2] <= stripe[0]


def _parity_name_not_hex(doc: dict, obj: int) -> None:
    _stripe_of(doc, obj)[2][0] = "../../../../" + "0" * 52  # 64 characters, not 64 hex digits


def _object_outside(doc: dict, obj: int) -> None:
    doc["objects"][obj] = "../x"  # a naive repairer writes what it rebuilds outside the repository


def _overlap(doc: dict, obj: int) -> None:
    lone = next(s for s in doc["stripes"] if len(s[1]) < doc["k"])
    lone[1].append([obj, 0, min(lone[0], doc["sizes"][obj])])  # bytes of the object a second time


#: name -> (what, (problem, "rebuild") or None: rebuilt, how to damage the parity repository).
PARITY_CASES: dict[str, tuple[str, tuple[str, str] | None, Callable[[Path], object]]] = {
    "parity-chunks-lost": ("M chunks of one stripe deleted: rebuilt from the other K pieces", None,
                           lambda repo: _lose_chunks(repo, 2)),
    "parity-chunks-damaged": ("a chunk with a byte flipped (found by decoding and hashing it, spec 5.4) and a "
                              "chunk cut short in one stripe, and the single piece of a stripe of fewer than K "
                              "pieces deleted (its other places are zeros)", None, _damage_chunks),
    "parity-manifest-lost": ("the manifest and a chunk of its stripe deleted: the manifest is rebuilt first "
                             "(checked by its hash), then the chunk (checked through the rebuilt manifest)", None,
                             _lose_manifest_and_chunk),
    "parity-object-damaged": ("a parity object with a byte flipped and a chunk deleted in one stripe (two "
                              "erasures), a parity object cut short in another: all three rebuilt", None,
                              _damage_parity),
    "parity-folder-lost": ("the checkpoint's folder deleted (commit record, manifest, record): a copy of the "
                           "record outside the folder proves the commit; the manifest, the commit record and "
                           "the record in the folder are rebuilt", None, _lose_folder),
    "parity-too-many-lost": ("M chunks of a stripe deleted and one of its parity objects damaged: M+1 pieces "
                             "of a stripe lost, nothing of it may be written", ("not-rebuildable", "rebuild"),
                             _too_many),
    "parity-uncommitted": ("no commit record and no copy of the record outside the folder (a save killed before "
                           "its commit): the commit record must not be rebuilt from the folder's record",
                           ("not-committed", "rebuild"), _uncommitted),
    "parity-piece-past-object": ("a chunk lost; the record has a piece that runs one byte past its object",
                                 ("invalid-manifest", "rebuild"), _hostile(_piece_past_object)),
    "parity-name-not-hex": ("a chunk lost; a parity object of its stripe is named '../../../../000...' (64 "
                            "characters, not 64 hex digits)", ("invalid-manifest", "rebuild"),
                            _hostile(_parity_name_not_hex)),
    "parity-object-outside": ("a chunk lost; the record names it '../x', a key outside the repository",
                              ("invalid-manifest", "rebuild"), _hostile(_object_outside)),
    "parity-k-plus-m-over-256": ("a chunk lost; the record says K = 255, M = 2 (K + M over 256)",
                                 ("invalid-manifest", "rebuild"), _hostile(lambda doc, obj: doc.update(k=255))),
    "parity-pieces-overlap": ("a chunk lost; the record gives its first bytes a second piece, in another stripe "
                              "(the pieces do not tile it)", ("invalid-manifest", "rebuild"), _hostile(_overlap)),
    "parity-record-renamed": ("a chunk lost; every copy of the record holds other bytes than its name's (two "
                              "parity names swapped): no good copy", ("corrupt-data", "rebuild"),
                              _hostile(lambda doc, obj: doc["stripes"][0][2].reverse(), rehash=False)),
}


def files_of(repo: Path) -> dict[str, bytes]:
    return {p.relative_to(repo).as_posix(): p.read_bytes() for p in sorted(repo.rglob("*")) if p.is_file()}


def write_parity_case(name: str, repos: Path, accepted: dict) -> dict:
    """The parity repository with objects lost; what a repairer rebuilds from it (spec 5.6), or refuses."""
    what, refused, damage = PARITY_CASES[name]
    repo = repos / name
    shutil.copytree(repos / "parity", repo)
    before = files_of(repo)
    commit = "step-1/COMMIT"
    damage(repo)
    after = files_of(repo)
    # Lost: what the damage deleted or changed; not the record and commit record a hostile case rewrote.
    rewritten = {key for key in before if "/parity-" in key} | {commit} if refused and refused[0] in (
        "invalid-manifest", "corrupt-data") else set()
    lost = sorted(key for key in before if after.get(key) != before[key] and key not in rewritten)
    case = {"name": name, "repository": f"repos/{name}", "checkpoint": "step-1", "what": what, "lost": lost}
    if refused:
        return {**case, "expect": "refuse", "problem": refused[0], "when": refused[1]}
    case |= {"expect": "rebuild", "rebuilt": {key: hashlib.sha256(before[key]).hexdigest()
                                              for key in lost if key != commit}}
    if commit in lost:
        case["commit"] = json.loads(before[commit])
    base = accepted["parity"]
    return {**case, **{key: base[key] for key in ("tensors", "metadata", "codecs", "state", "user")}}


def write_refused(name: str, repos: Path, accepted: dict[str, dict]) -> dict:
    source, (problem, when), what, damage = REFUSED[name]
    repo = repos / name
    shutil.copytree(repos / source, repo)
    damage(repo)
    base = accepted[source]
    case = {"name": name, "repository": f"repos/{name}", "checkpoint": base["checkpoint"], "what": what,
            "expect": "refuse", "problem": problem, "when": when}
    if "trusted_keys" in base:
        case["trusted_keys"] = base["trusted_keys"]
    return case


def main() -> None:
    repos = ROOT / "repos"
    shutil.rmtree(repos, ignore_errors=True)
    repos.mkdir(parents=True)
    key = ROOT / KEY
    if not key.exists():
        key.parent.mkdir(exist_ok=True)
        ckptfmt.generate_key(key)
    cases: list[dict] = []
    for name in ACCEPTED:
        cases += write_accepted(name, repos, key)
    last = {case["repository"].removeprefix("repos/"): case for case in cases}
    for name in REFUSED:
        cases.append(write_refused(name, repos, last))
    for name in PARITY_CASES:
        cases.append(write_parity_case(name, repos, last))
    (ROOT / "cases.json").write_text(json.dumps({"format": "ckptfmt-conformance", "cases": cases}, indent=1) + "\n")
    size = sum(p.stat().st_size for p in ROOT.rglob("*") if p.is_file())
    digest = hashlib.sha256((ROOT / "cases.json").read_bytes()).hexdigest()[:12]
    print(f"{len(cases)} cases, {size / 1024:.0f} KiB, cases.json {digest}")


if __name__ == "__main__":
    main()
