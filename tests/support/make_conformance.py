"""Writes spec/conformance/: small checkpoints and hostile variants of them, each with what a reader must do.

``.venv/bin/python -m tests.support.make_conformance`` replaces spec/conformance/repos/ and cases.json.
The accepted checkpoints are written by ckptfmt's own ``save`` (one per layout and codec family: maps and
columns, packs, every codec of format 2.0, deltas, shard grids, a format-1.6 floor, a signature), then
slimmed: the optional run metadata (environment, timing, RNG states) is dropped from each manifest and
the commit index from the repository, so that the suite stays small; every other byte is the writer's.
What each tensor must read as is taken from the values given to ``save``, never from a reader. Each
refused case is an accepted one with one thing broken, re-hashed where needed so that the reader meets
that thing and not an earlier check. tests/format/test_conformance.py runs ckptfmt and
tests/support/spec_reader.py over the result.
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
    (ROOT / "cases.json").write_text(json.dumps({"format": "ckptfmt-conformance", "cases": cases}, indent=1) + "\n")
    size = sum(p.stat().st_size for p in ROOT.rglob("*") if p.is_file())
    digest = hashlib.sha256((ROOT / "cases.json").read_bytes()).hexdigest()[:12]
    print(f"{len(cases)} cases, {size / 1024:.0f} KiB, cases.json {digest}")


if __name__ == "__main__":
    main()
