"""Structure-aware fuzzing of manifests, commit records and repository markers (``make fuzz``).

    python -m tests.support.fuzz_inputs [--cases 10000] [--seed 0] [--case N] [--json OUT]

Each case takes a real checkpoint's manifest (decoded to its msgpack tree, the
embedded value trees and their extension payloads included), its commit record
or the repository marker, applies one to three mutations (values of another
type, counts inflated, indices and sizes out of range, deep nesting, huge and
boundary integers, duplicate map keys, deleted and unknown fields, and in one
case of ten raw byte damage), writes the result into a local repository
(committing a mutated manifest under its own hash, so that the parser, not the
hash check, meets it) and reads it with every reader: ``open`` (keys, metadata,
every tensor), ``load``, ``restore_rng``, ``verify``, ``diff``, and the CLI's
``show``, ``show --json`` and ``ls``.

A case passes when every reader either succeeds or raises a
``ckptfmt.CheckpointError``; the run also records each case's time and its
memory above the interpreter's level before the case (peak RSS, reset per
case through /proc/self/clear_refs). The same seed gives the same cases.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import random
import shutil
import statistics
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
from rich.console import Console

import ckptfmt
from ckptfmt import CheckpointError
from ckptfmt.cli import build_parser
from ckptfmt.format import layout
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.values import OpaqueObject
from ckptfmt.tools.diff import diff
from tests.support.spec_reader import chunk_rows

#: What one case may cost (the issue's bounds), checked by the quick test and reported by the script:
#: CPU seconds (the work a case costs, whatever else the machine runs), and wall seconds against a hang.
CASE_SECONDS = 1.0
CASE_WALL_SECONDS = 10.0
CASE_BYTES = 256 * 2**20
#: Mutations never grow a document past this, so that a case tests the reader, not the disk.
MAX_DOCUMENT_BYTES = 4 * 2**20


# -- the trees being mutated ----------------------------------------------------------------------


@dataclass
class Ext:
    """A value-tree extension with its payload decoded (code 3, a big int, keeps its ASCII bytes)."""

    code: int
    payload: Any


@dataclass
class Embedded:
    """A bin field holding a msgpack document (``state``, ``user``), decoded for mutation."""

    tree: Any


@dataclass
class DupMap:
    """A map written with the same key twice."""

    pairs: list


@dataclass
class Deep:
    """``depth`` nested arrays (or maps) around nil: encoded without recursion."""

    depth: int
    maps: bool = False


def decode_value_tree(data: bytes) -> Any:
    def ext(code: int, payload: bytes) -> Ext:
        if code == 3:
            return Ext(code, payload)
        try:
            return Ext(code, msgpack.unpackb(payload, raw=False, strict_map_key=False, ext_hook=ext))
        except Exception:  # an undecodable payload stays as raw bytes
            return Ext(code, payload)

    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext)


def decode_manifest(data: bytes) -> dict:
    doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    for name in ("state", "user"):
        doc[name] = Embedded(decode_value_tree(doc[name]))
    return doc


_PACKER = msgpack.Packer(use_bin_type=True, unicode_errors="surrogatepass")  # lone surrogates: invalid UTF-8


def encode(value: Any) -> bytes:
    """msgpack bytes of a (mutated) tree, with the special nodes above."""
    if isinstance(value, Deep):
        inner = b"\x81\xc0\xc0" if value.maps else b"\x91"
        return inner * value.depth + b"\xc0"
    if isinstance(value, Embedded):
        return _PACKER.pack(encode(value.tree))
    if isinstance(value, Ext):
        payload = value.payload if isinstance(value.payload, bytes) and value.code == 3 else encode(value.payload)
        return _PACKER.pack(msgpack.ExtType(value.code % 128, payload))
    if isinstance(value, (dict, DupMap)):
        pairs = value.pairs if isinstance(value, DupMap) else list(value.items())
        return _PACKER.pack_map_header(len(pairs)) + b"".join(encode(k) + encode(v) for k, v in pairs)
    if isinstance(value, (list, tuple)):
        return _PACKER.pack_array_header(len(value)) + b"".join(encode(v) for v in value)
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        value = 2**64 - 1 if value > 0 else -(2**63)  # msgpack's own range ends here
    return _PACKER.pack(value)


def encode_json(value: Any) -> bytes:
    """JSON bytes of a (mutated) commit record or marker."""
    if isinstance(value, Deep):
        return ("[" * value.depth + "null" + "]" * value.depth).encode()
    if isinstance(value, DupMap):
        return ("{" + ",".join(f"{encode_json(str(k)).decode()}:{encode_json(v).decode()}" for k, v in value.pairs)
                + "}").encode()
    if isinstance(value, dict):
        return encode_json(DupMap(list(value.items())))
    if isinstance(value, (list, tuple)):
        return ("[" + ",".join(encode_json(v).decode() for v in value) + "]").encode()
    if isinstance(value, (bytes, Ext, Embedded)):
        value = repr(value)
    return json.dumps(value).encode()


# -- mutations ----------------------------------------------------------------------------------------

INTERESTING_INTS = [0, 1, -1, 2, 3, 7, 64, 65, 255, 256, 4095, 4096, 2**31 - 1, 2**31, 2**32, 2**32 + 1,
                    2**48, 2**48 + 1, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), -(2**31)]
INTERESTING_STRINGS = ["", "x", "none", "zstd", "shuffle4-zstd", "snappy", "float32", "bfloat16", "int4", "tensor",
                       "parameter", "numpy", "sparse", "ckptfmt-manifest", "ckptfmt-commit", "ckptfmt-repository",
                       "chunks", "Chunks", "..", "../../etc/passwd", "a/b", "a" * 129, "é" * 3000, "\x00", "\ud800",
                       "0" * 64, "f" * 64, "G" * 64, "step-1", "cuda:0", "meta"]


def interesting(rng: random.Random, base_strings: list[str]) -> Any:
    """A value of some type that a reader might not expect here."""
    kind = rng.randrange(12)
    if kind == 0:
        return rng.choice(INTERESTING_INTS)
    if kind == 1:
        return rng.choice(INTERESTING_STRINGS + base_strings)
    if kind == 2:
        return rng.choice([None, True, False])
    if kind == 3:
        return rng.choice([0.5, -0.0, math.nan, math.inf, -math.inf, 1e308, 5e-324])
    if kind == 4:
        return rng.choice([b"", b"\x00", b"\x80", b"\xc1", bytes(rng.randrange(256) for _ in range(16))])
    if kind == 5:
        return rng.choice([[], [0], [0, 0, 0], [2**63 - 1] * 3, [None], [[]], ["x"]])
    if kind == 6:
        return rng.choice([{}, {"a": 1}, {0: 1}, {"hash": "0" * 64}, {None: None}])
    if kind == 7:
        return Deep(rng.choice([2, 64, 255, 256, 257, 1000, 5000, 100_000]), maps=rng.random() < 0.3)
    if kind == 8:
        return Ext(rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 99, -1]),
                   rng.choice([0, -1, 2**40, b"12", b"-" * 5000, "x", [], [1, 2], {"module": 1}, None]))
    if kind == 9:
        return rng.choice(INTERESTING_INTS) * rng.choice([1, -1])
    if kind == 10:
        return rng.choice(base_strings) if base_strings else "x"
    return "x" * rng.choice([1, 1000, 100_000])


def children(node: Any) -> list[tuple[Any, Any]]:
    """(container, key) of each child of ``node`` that mutations may replace."""
    if isinstance(node, dict):
        return [(node, k) for k in node]
    if isinstance(node, list):
        return [(node, i) for i in range(len(node))]
    if isinstance(node, (Ext, Embedded)):
        return [(node, "payload" if isinstance(node, Ext) else "tree")]
    return []


def get(container: Any, key: Any) -> Any:
    return getattr(container, key) if isinstance(container, (Ext, Embedded)) else container[key]


def put(container: Any, key: Any, value: Any) -> None:
    if isinstance(container, (Ext, Embedded)):
        setattr(container, key, value)
    else:
        container[key] = value


def slots(root: Any, rng: random.Random, limit: int = 4000) -> list[tuple[Any, Any]]:
    """A sample of the tree's slots, found breadth first (big chunk tables stay cheap)."""
    found, queue = [], [root]
    while queue and len(found) < limit:
        node = queue.pop(rng.randrange(len(queue)) if len(queue) > 64 else 0)
        for slot in children(node):
            found.append(slot)
            queue.append(get(*slot))
    return found


def mutate(root: Any, rng: random.Random, base_strings: list[str]) -> str:
    """Apply one mutation somewhere in ``root``; returns its name."""
    candidates = slots(root, rng)
    if not candidates:
        return "none"
    container, key = rng.choice(candidates)
    value = get(container, key)
    op = rng.randrange(9)
    if op == 0:
        put(container, key, interesting(rng, base_strings))
        return "swap-type"
    if op == 1 and isinstance(value, int) and not isinstance(value, bool):
        put(container, key, rng.choice([value + 1, value - 1, value * 2, -value, value + 2**32, 2**63 - 1,
                                        value * 4096, 0]))
        return "tweak-int"
    if op == 2 and isinstance(value, list) and value:
        times = rng.choice([2, 10, 100, 1000])
        if len(encode(value)) * times < MAX_DOCUMENT_BYTES // 4:  # copies, not references: a later mutation
            put(container, key, [copy.deepcopy(item) for _ in range(times) for item in value])  # changes one
            return "inflate-count"
    if op == 3 and isinstance(container, dict):
        del container[key]
        return "delete-field"
    if op == 4 and isinstance(container, list):
        del container[key]
        return "delete-item"
    if op == 5 and isinstance(value, dict) and value:
        pairs = list(value.items())
        dup_key, _ = rng.choice(pairs)
        put(container, key, DupMap(pairs + [(dup_key, interesting(rng, base_strings))]))
        return "duplicate-key"
    if op == 6 and isinstance(value, dict):
        value[rng.choice(["future", "hash", "pieces", 0, None])] = interesting(rng, base_strings)
        return "add-field"
    if op == 7:
        put(container, key, Deep(rng.choice([100, 300, 2000, 50_000]), maps=rng.random() < 0.5))
        return "deep-nesting"
    if op == 8 and isinstance(value, list) and len(value) == 3 and all(type(v) is int for v in value):
        position = rng.randrange(3)  # a piece: [chunk, offset, length]
        value[position] = rng.choice([value[position] + 1, 2**63 - 1, -1, 10**6, 0])
        return "piece-out-of-range"
    put(container, key, interesting(rng, base_strings))
    return "swap-type"


def damage_bytes(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    op = rng.randrange(4)
    if op == 0 and data:
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif op == 1:
        del data[rng.randrange(len(data) + 1):]
    elif op == 2:
        data[rng.randrange(len(data) + 1):0] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 32)))
    else:
        start = rng.randrange(len(data) + 1)
        data[start:start] = data[start : start + rng.randrange(1, 4096)] * rng.randrange(2, 8)
    return bytes(data)


# -- the repository under test ---------------------------------------------------------------------------


def base_state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(32, 16, generator=gen))
    full = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    return {
        "model": {"w": param, "tied": param, "big": torch.randn(200_000, generator=gen),
                  "bf16": torch.ones(8, 8, dtype=torch.bfloat16), "scalar": torch.tensor(2.5),
                  "empty": torch.empty(0, 4), "ints": torch.arange(1000, dtype=torch.int64)},
        "sharded": ckptfmt.Sharded((64, 64), [ckptfmt.Shard((r, c), full[r:r + 32, c:c + 32].clone(), r // 32)
                                              for r in (0, 32) for c in (0, 32)]),
        "array": np.arange(7, dtype=np.int16),
        "meta": {"step": 3, "pair": (1, 2), 5: [None, b"x"], "big": 10**30, "od": OrderedDict(a=1),
                 "set": {1, 2}, "fs": frozenset({"a"}), "z": 1 + 2j, "dtype": torch.float16,
                 "size": torch.Size([2, 3]), "device": torch.device("cpu"), "np": np.float32(1.5),
                 "opaque": OpaqueObject("m", "Q", b"\x80\x04N.")},
    }


@dataclass
class Base:
    """The repository under test: base checkpoints, their documents, and the strings they use."""

    root: Path
    repo: Path
    marker_repo: Path
    manifests: list[bytes]
    commits: list[dict]
    marker: bytes
    strings: list[str] = field(default_factory=list)
    #: A checkpoint saved with the float codec, and its chunks of planes (spec 5.3): the "chunk" target.
    float_record: dict = field(default_factory=dict)
    float_manifest: bytes = b""
    float_chunks: list[Path] = field(default_factory=list)


def build_base(root: Path) -> Base:
    repo, marker_repo = root / "repo", root / "marker-repo"
    for i, (compression, chunk_size) in enumerate(((None, 65536), ("shuffle-zstd", 2**20))):
        ckptfmt.save(base_state(i), repo / f"base{i}", step=i, compression=compression, chunk_size=chunk_size,
                     metadata={"lr": 1e-3, "tags": ["a", "b"], "nested": {"x": [1, 2, 3]}},
                     step_times=[0.1, 0.2], parallelism={"dp": 1}, provenance={"source_kind": "fuzz"})
    ckptfmt.save(base_state(2), repo / "floats", step=2, compression="float-zstd", chunk_size=2**20)
    ckptfmt.save({"w": torch.ones(3)}, marker_repo / "only")
    storage = ckptfmt.Repository.open(repo).storage
    manifests, commits = [], []
    for name in ("base0", "base1"):
        record = json.loads(storage.read(layout.commit_key(name), max_size=2**20))
        commits.append(record)
        manifests.append(storage.read(layout.manifest_key(name, record["manifest"]), max_size=2**28))
    chunk_hashes = [row["hash"] for m in manifests for row in chunk_rows(msgpack.unpackb(m, raw=False)["chunks"])]
    marker = (marker_repo / layout.MARKER_KEY).read_bytes()
    record = json.loads(storage.read(layout.commit_key("floats"), max_size=2**20))
    floats = storage.read(layout.manifest_key("floats", record["manifest"]), max_size=2**28)
    planes = sorted(path for path in (repo / layout.CHUNKS_DIR).rglob("*") if path.suffix.startswith(".float"))
    return Base(root, repo, marker_repo, manifests, commits, marker, strings=chunk_hashes[:4] + ["base0", "base1"],
                float_record=record, float_manifest=floats, float_chunks=planes)


@dataclass
class Case:
    index: int
    target: str  # "manifest", "commit", "marker" or "chunk" (a float codec's planes)
    mutations: list[str]
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    extra_bytes: int = 0
    outcomes: dict = field(default_factory=dict)  # reader -> "ok" or the CheckpointError subclass name
    failures: list[str] = field(default_factory=list)


NAME = "case"


def make_case(base: Base, index: int, seed: int) -> tuple[Case, Callable[[], None]]:
    """Write case ``index`` into the repositories; returns it and a function that removes it."""
    rng = random.Random(seed * 1_000_003 + index)
    roll = rng.random()
    target = "manifest" if roll < 0.65 else "commit" if roll < 0.8 else "marker" if roll < 0.9 else "chunk"
    which = rng.randrange(len(base.manifests))
    mutations = []
    if target == "chunk":
        return _damaged_planes_case(base, index, rng)
    if target == "marker":
        doc = json.loads(base.marker)
        data = _mutated_json(doc, rng, base, mutations)
        (base.marker_repo / layout.MARKER_KEY).write_bytes(data)
        return Case(index, target, mutations), lambda: (base.marker_repo / layout.MARKER_KEY).write_bytes(base.marker)
    record = {**copy.deepcopy(base.commits[which]), "name": NAME}
    manifest = base.manifests[which]
    if target == "manifest":
        doc = decode_manifest(manifest)
        doc["name"] = NAME
        if rng.random() < 0.1:
            manifest = damage_bytes(encode(doc), rng)
            mutations.append("damage-bytes")
        else:
            for _ in range(rng.randrange(1, 4)):
                mutations.append(mutate(doc, rng, base.strings))
            manifest = encode(doc)
        record.update(manifest=chunk_hash(manifest), manifest_size=len(manifest))
        commit = json.dumps(record).encode()
    else:
        doc = decode_manifest(manifest)
        doc["name"] = NAME
        manifest = encode(doc)
        record.update(manifest=chunk_hash(manifest), manifest_size=len(manifest))
        commit = _mutated_json(record, rng, base, mutations)
    folder = base.repo / NAME
    folder.mkdir()
    (folder / f"manifest-{chunk_hash(manifest)}.msgpack").write_bytes(manifest)
    (folder / layout.COMMIT_NAME).write_bytes(commit)
    return Case(index, target, mutations), lambda: shutil.rmtree(folder)


def _damaged_planes_case(base: Base, index: int, rng: random.Random) -> tuple[Case, Callable[[], None]]:
    """A chunk of float planes damaged (its bytes, or one plane's length in its header set to an edge),
    read through a checkpoint that names it: the decode must refuse it, whatever its header claims."""
    path = rng.choice(base.float_chunks)
    original = path.read_bytes()
    if rng.random() < 0.5:
        mutation, damaged = "damage-bytes", damage_bytes(original, rng)
    else:
        width = int(path.suffix.split("-")[0].removeprefix(".float"))  # the element width in bytes
        lengths = list(struct.unpack_from(f"<{width}Q", original))
        j = rng.randrange(width)
        lengths[j] = rng.choice([0, 1, lengths[j] - 1, lengths[j] + 1, sum(lengths), 2**63, 2**64 - 1,
                                 rng.randrange(2**32)]) % 2**64
        mutation, damaged = "plane-length", struct.pack(f"<{width}Q", *lengths) + original[8 * width:]
    path.write_bytes(damaged)
    doc = decode_manifest(base.float_manifest)
    doc["name"] = NAME
    manifest = encode(doc)
    record = {**base.float_record, "name": NAME, "manifest": chunk_hash(manifest), "manifest_size": len(manifest)}
    folder = base.repo / NAME
    folder.mkdir()
    (folder / f"manifest-{chunk_hash(manifest)}.msgpack").write_bytes(manifest)
    (folder / layout.COMMIT_NAME).write_bytes(json.dumps(record).encode())

    def cleanup() -> None:
        path.write_bytes(original)
        shutil.rmtree(folder)
    return Case(index, "chunk", [mutation]), cleanup


def _mutated_json(doc: dict, rng: random.Random, base: Base, mutations: list[str]) -> bytes:
    if rng.random() < 0.15:
        mutations.append("damage-bytes")
        return damage_bytes(json.dumps(doc).encode(), rng)
    for _ in range(rng.randrange(1, 4)):
        mutations.append(mutate(doc, rng, base.strings))
    return encode_json(doc)


# -- the readers ---------------------------------------------------------------------------------------------


def readers(base: Base, case: Case) -> dict[str, Callable[[], Any]]:
    repo = base.marker_repo if case.target == "marker" else base.repo
    url = str(repo / ("only" if case.target == "marker" else NAME))
    console = Console(file=io.StringIO(), width=120)

    def open_all():
        with ckptfmt.open(url) as ckpt:
            ckpt.metadata  # noqa: B018 - decoding the user tree is part of reading
            for key in ckpt.keys():
                ckpt.tensor_info(key)
                ckpt.get_tensor(key)

    def restore_rng():
        saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
        try:
            ckptfmt.restore_rng(url, rank=0)
        finally:
            torch.set_rng_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])

    def cli(*argv: str):
        args = build_parser().parse_args(list(argv))
        return args.run(args, console)

    return {
        "open": open_all,
        "load": lambda: ckptfmt.load(url),
        "restore_rng": restore_rng,
        "verify": lambda: ckptfmt.verify(url),
        "diff": lambda: diff(str(repo / ("only" if case.target == "marker" else "base0")), url),
        "show": lambda: cli("show", url, "--limit", "0"),
        "show --json": lambda: cli("show", url, "--json"),
        "ls": lambda: cli("ls", str(repo)),
    }


def run_case(base: Base, index: int, seed: int) -> Case:
    case, cleanup = make_case(base, index, seed)
    try:
        baseline = _rss_and_reset()
        started, started_cpu = time.perf_counter(), time.process_time()
        for name, read in readers(base, case).items():
            try:
                with contextlib.redirect_stderr(io.StringIO()), _quiet_warnings():
                    read()
                case.outcomes[name] = "ok"
            except CheckpointError as exc:
                case.outcomes[name] = type(exc).__name__
            except Exception:  # a reader that breaks the contract
                case.outcomes[name] = "FAILED"
                case.failures.append(f"{name}: {traceback.format_exc(limit=6)}")
        case.seconds = time.perf_counter() - started
        case.cpu_seconds = time.process_time() - started_cpu
        case.extra_bytes = max(0, _peak_rss() - baseline)
    finally:
        cleanup()
    return case


@contextlib.contextmanager
def _quiet_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _rss_and_reset() -> int:
    """This process's resident memory now, after resetting its recorded peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field_name} in /proc/self/status")


# -- the script --------------------------------------------------------------------------------------------------


def run(cases: range, seed: int, progress: Callable[[Case], None] | None = None) -> list[Case]:
    with tempfile.TemporaryDirectory(prefix="ckptfmt-fuzz-") as tmp:
        base = build_base(Path(tmp))
        done = []
        for index in cases:
            case = run_case(base, index, seed)
            done.append(case)
            if progress:
                progress(case)
        return done


def summary(cases: list[Case]) -> dict:
    seconds = sorted(c.seconds for c in cases)
    cpu = sorted(c.cpu_seconds for c in cases)
    memory = sorted(c.extra_bytes for c in cases)
    outcomes = Counter(f"{reader}: {outcome}" for c in cases for reader, outcome in c.outcomes.items())
    return {
        "cases": len(cases),
        "by_target": dict(Counter(c.target for c in cases)),
        "mutations": dict(Counter(m for c in cases for m in c.mutations).most_common()),
        "reads": sum(len(c.outcomes) for c in cases),
        "failed_cases": [c.index for c in cases if c.failures],
        "over_time": [c.index for c in cases if c.cpu_seconds > CASE_SECONDS or c.seconds > CASE_WALL_SECONDS],
        "over_memory": [c.index for c in cases if c.extra_bytes > CASE_BYTES],
        "seconds": {"median": statistics.median(seconds), "p99": seconds[int(len(seconds) * 0.99)],
                    "max": seconds[-1], "total": sum(seconds)},
        "cpu_seconds": {"median": statistics.median(cpu), "p99": cpu[int(len(cpu) * 0.99)], "max": cpu[-1]},
        "extra_mib": {"median": statistics.median(memory) / 2**20, "p99": memory[int(len(memory) * 0.99)] / 2**20,
                      "max": memory[-1] / 2**20},
        "outcomes": dict(sorted(outcomes.items())),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", type=int, help="run only this case and print its failures in full")
    parser.add_argument("--json", help="write the summary as JSON to this path")
    args = parser.parse_args()
    indexes = range(args.case, args.case + 1) if args.case is not None else range(args.cases)
    started = time.perf_counter()

    seen: set[str] = set()

    def progress(case: Case) -> None:
        if case.failures or case.index % 500 == 0:
            print(f"case {case.index}: {case.target} {case.mutations} {case.seconds:.3f} s "
                  f"{case.extra_bytes / 2**20:.0f} MiB{' FAILED' if case.failures else ''}", flush=True)
        for failure in case.failures:  # each distinct failing line once
            where = failure.strip().splitlines()[-3:]
            if args.case is not None or str(where) not in seen:
                seen.add(str(where))
                print(failure, flush=True)

    cases = run(indexes, args.seed, progress)
    report = summary(cases)
    report["wall_seconds"] = time.perf_counter() - started
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    bad = report["failed_cases"] or report["over_time"] or report["over_memory"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
