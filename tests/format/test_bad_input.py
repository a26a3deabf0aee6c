"""Hostile and damaged input: every reader path raises a CheckpointError, and nothing else.

Property tests mutate a real manifest (bytes and structure), value trees and
commit records; directed tests pin down each validation rule (limits, names,
versions) with the error type it must raise.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import random
import threading
import uuid
from collections import OrderedDict

import fsspec
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfmt
from ckptfmt import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptDataError,
    InvalidNameError,
    ManifestError,
    UnsupportedValueError,
    UnsupportedVersionError,
)
from ckptfmt.format import layout
from ckptfmt.format import manifest as manifest_module
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.limits import check_hash, check_name
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.values import decode_tree, encode_tree
from ckptfmt.loading.reader import CheckpointReader
from ckptfmt.repository.repository import CommitRecord, Repository
from ckptfmt.storage.factory import open_storage
from tests.support.helpers import ANY_SIZE, assert_same, rewrite_manifest
from tests.support.spec_reader import chunk_rows, tensor_rows

NAME = "victim"

# -- a real checkpoint to mutate -------------------------------------------------------


def base_state() -> dict:
    param = torch.nn.Parameter(torch.randn(3, 2, generator=torch.Generator().manual_seed(0)))
    return {
        "big": torch.arange(70_000, dtype=torch.int32),  # 280 KB: five 64 KiB pieces
        "param": param,
        "again": param,  # same_as
        "bf16": torch.ones(4, 4, dtype=torch.bfloat16),
        "array": np.arange(5, dtype=np.int16),
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 3),
        "meta": {"step": 3, "pair": (1, 2), 5: [None, b"x"]},
    }


@pytest.fixture(scope="module")
def victim():
    """A memory:// repository holding checkpoint NAME; yields (repo url, manifest bytes)."""
    root = f"memory:///ckptfmt-bad-input-{uuid.uuid4().hex}"
    url = f"{root}/repo"
    ckptfmt.save(base_state(), f"{url}/{NAME}", chunk_size=65536, metadata={"run": "base"})
    repo = Repository.open(url)
    data = repo.storage.read(layout.manifest_key(NAME, repo.commit(NAME).manifest_hash), max_size=ANY_SIZE)
    yield url, data
    fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


@pytest.fixture(scope="module")
def base_bytes(victim) -> list[bytes]:
    """The real manifest, and a lean copy without the bulky rng/environment records,
    so that random byte damage mostly lands on the tables that matter."""
    data = victim[1]
    manifest = Manifest.from_bytes(data, "base")
    lean = dataclasses.replace(manifest, rng=[], environment={}, timing={})
    return [data, lean.to_bytes()]


def install(repo_url: str, data: bytes, name: str = NAME) -> str:
    """Make ``data`` the manifest of checkpoint ``name``, with a commit record that matches it."""
    storage = open_storage(repo_url)
    digest = chunk_hash(data)
    storage.write(layout.manifest_key(name, digest), data)
    record = CommitRecord(name=name, manifest_hash=digest, manifest_size=len(data), step=None,
                          created_ns=1, parent=None, totals={})
    storage.write(layout.commit_key(name), record.to_bytes())
    return f"{repo_url}/{name}"


def parse_or_checkpoint_error(data: bytes) -> Manifest | None:
    try:
        return Manifest.from_bytes(data, "mutated")
    except CheckpointError as exc:
        assert "mutated" in str(exc)  # names the file
        return None


@contextlib.contextmanager
def generators_kept():
    """Put the torch, numpy and Python RNG states back after a block that may restore_rng()."""
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


def call_each_allowing_checkpoint_errors(calls) -> None:
    """Run every call; each may succeed or refuse, but only with a CheckpointError."""
    for call in calls:
        try:
            call()
        except CheckpointError:
            pass


def read_everything_or_checkpoint_error(repo_url: str, data: bytes) -> None:
    """Every reader entry point, on a checkpoint whose manifest is ``data``."""
    url = install(repo_url, data)
    with generators_kept():
        call_each_allowing_checkpoint_errors([
            lambda: ckptfmt.load(url),
            lambda: ckptfmt.verify(url),
            lambda: ckptfmt.open(url).metadata,
            lambda: [r.get_tensor(k) for r in [ckptfmt.open(url)] for k in r.keys()],
            lambda: ckptfmt.restore_rng(url),
        ])


# -- strategies ----------------------------------------------------------------------

SPECIAL_VALUES = [
    -1, 0, 1, 3, 2**31, 2**62, 2**63 - 1, 2**64 - 1, -(2**63), 1.5, float("nan"), True, None,
    "", "../../etc/passwd", "..", "a/b", "float128", "bfloat16", "bits16", "none", "zstd", "shuffle4-zstd",
    "/absolute", "tensor", "numpy", "parameter", "0" * 64, "F" * 64, "victim", b"", b"\xc1",
    [], [2**62], [2**62, 2**62], [-1], [0], [0, 0], [1, 2], [2**63 - 1, 0], list(range(65)), [0] * 65,
    [0, 0, 2**62], [0, 2**62, 2**62], {}, {"hash": "../../x"}, [1, 0],
]

leaves = (
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=12) | st.sampled_from(SPECIAL_VALUES)
)
msgpack_values = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=8) | st.integers(-3, 3), children, max_size=5),
    max_leaves=12,
)


@st.composite
def byte_damage(draw, base: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(base)))
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, max(len(data) - 1, 0)))
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "overwrite"]))
        if op == "flip" and data:
            data[position] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[position:]
        elif op == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[position:position + draw(st.integers(1, 16))]
        elif op == "overwrite" and data:
            data[position] = draw(st.integers(0, 255))
    return bytes(data)


def _mutate_once(draw, doc: dict) -> None:
    """Walk down to a random field of the manifest tree and replace or delete it."""
    container = doc
    while True:
        keys = list(container) if isinstance(container, dict) else list(range(len(container)))
        if not keys:
            return
        key = draw(st.sampled_from(keys))
        child = container[key]
        if isinstance(child, (dict, list)) and child and draw(st.integers(0, 3)):
            container = child
            continue
        if draw(st.integers(0, 4)) == 0:
            del container[key]
        elif isinstance(child, bytes) and draw(st.booleans()):
            container[key] = draw(value_tree_bytes)  # an embedded value tree (state, user)
        else:
            # A copy: SPECIAL_VALUES holds lists and maps that a later mutation of this manifest would
            # change in place, and with them every later example (hypothesis: "inconsistent data generation").
            container[key] = copy.deepcopy(draw(msgpack_values))
        return


@st.composite
def structural_damage(draw, base: list[bytes]) -> bytes:
    doc = msgpack.unpackb(draw(st.sampled_from(base)), raw=False, strict_map_key=False)
    for _ in range(draw(st.integers(1, 3))):
        _mutate_once(draw, doc)
    return msgpack.packb(doc, use_bin_type=True)


ext_codes = st.integers(0, 13) | st.integers(0, 127)
hashable_leaves = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=6) | st.binary(max_size=6)
)
value_trees = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(hashable_leaves, children, max_size=4)
    | st.builds(lambda code, inner: msgpack.ExtType(code, msgpack.packb(inner, use_bin_type=True)), ext_codes, children)
    | st.builds(msgpack.ExtType, ext_codes, st.binary(max_size=16)),
    max_leaves=15,
)
value_tree_bytes = value_trees.map(lambda v: msgpack.packb(v, use_bin_type=True)) | st.binary(max_size=40)

# No example database: the base manifest differs per run (timestamps, environment), so
# replaying a stored example against a new base would draw a different structure.
FAST = settings(deadline=2000, max_examples=300, suppress_health_check=[HealthCheck.too_slow], database=None)
FULL_READ = settings(deadline=5000, max_examples=80, suppress_health_check=[HealthCheck.too_slow], database=None)


# -- property tests ------------------------------------------------------------------


def test_base_manifest_is_valid(victim, base_bytes):
    for data in base_bytes:
        manifest = Manifest.from_bytes(data, "base")
        assert manifest.name == NAME and len(manifest.tensors) == 7
    assert_same(base_state(), ckptfmt.load(f"{victim[0]}/{NAME}"))


@FAST
@given(data=st.data())
def test_damaged_manifest_bytes_raise_only_checkpoint_errors(base_bytes, data):
    parse_or_checkpoint_error(data.draw(byte_damage(base_bytes)))


@FAST
@given(data=st.data())
def test_mutated_manifest_fields_raise_only_checkpoint_errors(base_bytes, data):
    parse_or_checkpoint_error(data.draw(structural_damage(base_bytes)))


@FAST
@given(document=msgpack_values)
def test_arbitrary_msgpack_documents_raise_only_checkpoint_errors(document):
    parse_or_checkpoint_error(msgpack.packb(document, use_bin_type=True))


@FULL_READ
@given(data=st.data())
def test_readers_survive_damaged_manifests(victim, base_bytes, data):
    """Past the parser: load, open, get_tensor, verify and restore_rng on hostile manifests."""
    if data.draw(st.booleans()):
        damaged = data.draw(structural_damage(base_bytes))
    else:
        damaged = data.draw(byte_damage(base_bytes))
    try:
        read_everything_or_checkpoint_error(victim[0], damaged)
    finally:
        install(victim[0], victim[1])  # leave the module's victim intact


@FAST
@given(tree=value_tree_bytes)
def test_hostile_value_trees_raise_only_manifest_errors(tree):
    def resolve(index):
        if not 0 <= index < 3:
            raise CheckpointError("no such tensor")
        return torch.zeros(index)

    for resolver in (resolve, None):
        try:
            decode_tree(tree, resolver)
        except ManifestError:
            pass


@FAST
@given(document=msgpack_values, data=st.data())
def test_damaged_commit_records_raise_only_checkpoint_errors(document, data):
    valid = json.loads(CommitRecord(NAME, "a" * 64, 100, 1, 5, None, {}).to_bytes())
    candidates = [json.dumps(document, default=repr).encode()]
    key = data.draw(st.sampled_from(sorted(valid)))
    mutated = dict(valid)
    mutated[key] = json.loads(json.dumps(document, default=repr))
    candidates.append(json.dumps(mutated).encode())
    for candidate in candidates:
        try:
            CommitRecord.from_bytes(candidate, "COMMIT")
        except CheckpointError:
            pass


# -- directed tests: each validation rule ------------------------------------------------


def manifest_doc(base_bytes) -> dict:
    """The victim's manifest document, its tensor table as one map per entry (spec 6.4)."""
    doc = msgpack.unpackb(base_bytes[1], raw=False, strict_map_key=False)
    doc["tensors"], doc["chunks"] = tensor_rows(doc["tensors"]), chunk_rows(doc["chunks"])
    return doc


def find_tensor(doc: dict, key: str) -> dict:
    return next(t for t in doc["tensors"] if t["key"] == key)


MUTATIONS = {
    "not a map": lambda d: [d],
    "wrong format": lambda d: d.update(format="safetensors"),
    "missing chunks": lambda d: d.pop("chunks"),
    "chunks not a list": lambda d: d.update(chunks={"a": 1}),
    "tensors wrong type": lambda d: d.update(tensors="x"),
    "name traversal": lambda d: d.update(name="../x"),
    "parent traversal": lambda d: d.update(parent="a/b"),
    "step not int": lambda d: d.update(step="3"),
    "step bool": lambda d: d.update(step=True),
    "created_ns negative": lambda d: d.update(created_ns=-1),
    "state not bytes": lambda d: d.update(state="text"),
    "rng not maps": lambda d: d.update(rng=[1]),
    "environment wrong type": lambda d: d.update(environment=[]),
    "bad chunk hash": lambda d: d["chunks"][0].update(hash="../../etc/passwd"),
    "uppercase chunk hash": lambda d: d["chunks"][0].update(hash="A" * 64),
    "chunk size negative": lambda d: d["chunks"][0].update(size=-1),
    "chunk size absurd": lambda d: d["chunks"][0].update(size=2**62),
    "stored_size absurd": lambda d: d["chunks"][0].update(stored_size=2**62),
    "codec not a string": lambda d: d["chunks"][0].update(codec=5),
    "unknown dtype": lambda d: find_tensor(d, "big").update(dtype="float128"),
    "dtype not a string": lambda d: find_tensor(d, "big").update(dtype=4),
    "negative dim": lambda d: find_tensor(d, "big").update(shape=[-1]),
    "huge shape": lambda d: find_tensor(d, "big").update(shape=[2**62, 2**62]),
    "too many dims": lambda d: find_tensor(d, "big").update(shape=[1] * 65),
    "shape not a list": lambda d: find_tensor(d, "big").update(shape=70000),
    "empty key": lambda d: find_tensor(d, "big").update(key=""),
    "huge key": lambda d: find_tensor(d, "big").update(key="k" * 5000),
    "unknown kind": lambda d: find_tensor(d, "big").update(kind="sparse"),
    "requires_grad not bool": lambda d: find_tensor(d, "param").update(requires_grad=1),
    "no shards": lambda d: find_tensor(d, "big").update(shards=[]),
    "shard outside tensor": lambda d: find_tensor(d, "big")["shards"][0].update(offsets=[1]),
    "shard rank mismatch": lambda d: find_tensor(d, "big")["shards"][0].update(shape=[70000, 1]),
    "shards overlap": lambda d: find_tensor(d, "big")["shards"].append(find_tensor(d, "big")["shards"][0]),
    "chunk index out of range": lambda d: find_tensor(d, "big")["shards"][0]["pieces"][0].__setitem__(0, 10_000),
    "chunk index negative": lambda d: find_tensor(d, "big")["shards"][0]["pieces"][0].__setitem__(0, -1),
    "offset past chunk end": lambda d: find_tensor(d, "big")["shards"][0]["pieces"][0].__setitem__(1, 65536),
    "length past chunk end": lambda d: find_tensor(d, "big")["shards"][0]["pieces"][0].__setitem__(2, 65537),
    "pieces too short": lambda d: find_tensor(d, "big")["shards"][0]["pieces"].pop(),
    "piece not a triple": lambda d: find_tensor(d, "big")["shards"][0]["pieces"].__setitem__(0, [0, 0]),
    "same_as forward": lambda d: d["tensors"][0].update(same_as=1),
    "same_as self": lambda d: find_tensor(d, "again").update(same_as=2),
    "same_as other shape": lambda d: find_tensor(d, "again").update(same_as=0),
    "version malformed": lambda d: d.update(version="1.0"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_manifest_rule(base_bytes, mutation):
    doc = manifest_doc(base_bytes)
    result = MUTATIONS[mutation](doc)
    if isinstance(result, list):
        doc = result
    with pytest.raises(CheckpointError) as info:
        Manifest.from_bytes(msgpack.packb(doc, use_bin_type=True), "the-manifest")
    assert isinstance(info.value, (ManifestError, InvalidNameError))
    assert str(info.value).startswith("the-manifest: ")


def test_manifest_rules_do_not_reject_the_untouched_document(base_bytes):
    """The mutations above fail because of the mutation, not because the base is off."""
    doc = manifest_doc(base_bytes)
    assert Manifest.from_bytes(msgpack.packb(doc, use_bin_type=True), "x").name == NAME


@pytest.mark.parametrize("payload", [
    b"\x91" * 100_000 + b"\xc0",  # 100000 nested arrays
    b"\x81\xa1k" * 100_000 + b"\xc0",  # 100000 nested maps
    b"\xdd\xff\xff\xff\xff",  # an array claiming 4 billion items
    b"\xc6\xff\xff\xff\xf0" + b"x" * 10,  # a bin claiming 4 GB
    b"",
    b"\xc1",
])
def test_pathological_msgpack(payload):
    with pytest.raises(ManifestError):
        Manifest.from_bytes(payload, "m")
    with pytest.raises(ManifestError):
        decode_tree(payload)


def test_oversized_manifest(base_bytes, monkeypatch):
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", len(base_bytes[1]) - 1)
    with pytest.raises(ManifestError, match="over the"):
        Manifest.from_bytes(base_bytes[1], "m")


def test_oversized_files_are_refused_before_reading(tmp_path):
    repo = tmp_path / "repo"
    ckptfmt.save({"w": torch.ones(2)}, repo / "a")
    storage = open_storage(repo)
    commit = json.loads(storage.read(layout.commit_key("a"), max_size=ANY_SIZE))
    key = layout.manifest_key("a", commit["manifest"])

    storage.write(key, storage.read(key, max_size=ANY_SIZE) + b"\x00" * 10)  # bigger than the commit record says
    with pytest.raises(CorruptDataError, match="over the limit"):
        ckptfmt.load(repo / "a")

    storage.write(layout.commit_key("a"), json.dumps({**commit, "pad": " " * 70_000}).encode())
    with pytest.raises(CorruptDataError, match="over the limit"):
        ckptfmt.load(repo / "a")

    storage.write(layout.MARKER_KEY, json.dumps({"format": "ckptfmt-repository", "version": [1, 0],
                                                 "pad": "x" * 70_000}).encode())
    with pytest.raises(CorruptDataError, match="over the limit"):
        Repository.open(repo)


def test_deeply_nested_json_records(tmp_path):
    repo = tmp_path / "repo"
    ckptfmt.save({}, repo / "a")
    storage = open_storage(repo)
    storage.write(layout.commit_key("a"), b"[" * 60_000)
    with pytest.raises(ManifestError):
        ckptfmt.load(repo / "a")
    report = ckptfmt.verify(repo)
    assert [p.kind for p in report.problems] == ["bad-checkpoint"]
    storage.write(layout.MARKER_KEY, b"[" * 60_000)
    with pytest.raises(ManifestError):
        Repository.open(repo)


def nested_tuples(depth: int) -> bytes:
    """A value tree of tuples nested ``depth`` deep, each in its own extension payload."""
    nested = None
    for _ in range(depth):
        nested = msgpack.ExtType(2, msgpack.packb([nested], use_bin_type=True))
    return msgpack.packb(nested, use_bin_type=True)


@pytest.mark.parametrize("depth", [300, 1000, 5000])
def test_deeply_nested_extensions_are_refused(depth):
    with pytest.raises(ManifestError, match="nested deeper"):
        decode_tree(nested_tuples(depth))


def test_deep_extensions_do_not_exhaust_the_c_stack():
    """Each extension level is a nested parse. With msgpack.unpackb's parser state on the C stack,
    ~170 levels overflowed even the main thread's 8 MiB stack: a segfault, not an error."""
    results = []

    def decode():
        value = decode_tree(nested_tuples(250))
        depth = 0
        while isinstance(value, tuple):
            value, depth = value[0], depth + 1
        results.append(depth)

    previous = threading.stack_size(4 << 20)  # a worker thread with half the main thread's stack
    try:
        worker = threading.Thread(target=decode)
        worker.start()
        worker.join()
    finally:
        threading.stack_size(previous)
    assert results == [250]


def _nest(depth: int, leaf, wrap):
    value = leaf
    for _ in range(depth):
        value = wrap(value)
    return value


@pytest.mark.parametrize("shape", ["tuples", "ordered-dicts", "dict-then-tuples", "tuple-keys", "frozensets",
                                   "lists-then-tuples"])
def test_writer_and_reader_agree_on_the_nesting_limit(tmp_path, shape):
    """Whatever the writer accepts at its depth limit (256) loads back; one level more is refused."""
    makers = {
        "tuples": lambda k: _nest(k, torch.ones(1), lambda v: (v,)),
        "ordered-dicts": lambda k: _nest(k, torch.ones(1), lambda v: OrderedDict(a=v)),
        "dict-then-tuples": lambda k: {"x": _nest(k - 1, torch.ones(1), lambda v: (v,))},
        "tuple-keys": lambda k: {_nest(k - 1, 1, lambda v: (v,)): 1},
        "frozensets": lambda k: _nest(k, torch.float32, lambda v: frozenset({v})),
        "lists-then-tuples": lambda k: _nest(k // 2, _nest(k - k // 2, torch.Size([1]), lambda v: (v,)),
                                             lambda v: [v]),
    }
    make = makers[shape]
    ckptfmt.save(make(256), tmp_path / "repo" / "deepest")
    assert_same(make(256), ckptfmt.load(tmp_path / "repo" / "deepest"))
    with pytest.raises(UnsupportedValueError, match="nested deeper"):
        ckptfmt.save(make(257), tmp_path / "repo" / "too-deep")


def test_plain_nesting_beyond_the_limit_is_refused_at_save():
    deep: list = []
    cursor = deep
    for _ in range(300):
        cursor.append([])
        cursor = cursor[0]
    with pytest.raises(UnsupportedValueError, match="nested deeper"):
        encode_tree(deep)


def ext(code: int, body) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, msgpack.packb(body, use_bin_type=True)), use_bin_type=True)


def raw_ext(code: int, payload: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, payload), use_bin_type=True)


@pytest.mark.parametrize("payload", [
    ext(1, "not an int"), ext(1, 5), ext(1, -1),
    raw_ext(3, b"12a"), raw_ext(3, b"-"), raw_ext(3, b"--5"), raw_ext(3, b"9" * 20_000), raw_ext(3, b"9" * 5000),
    raw_ext(3, "\u0661".encode()),
    ext(2, {"a": 1}), ext(4, [1, 2]), ext(5, [[1]]), ext(6, [{}]), ext(5, {}),
    ext(7, [1]), ext(7, ["a", "b"]), ext(7, 5),
    ext(8, "float128"), ext(8, [1]), ext(8, None),
    ext(9, [-1, "x"]), ext(9, [1.5]), ext(9, "x"),
    ext(10, "quantum:0"), ext(10, 5), ext(10, "cuda:-5"),
    ext(11, ["O", b""]), ext(11, ["<f4", b"12"]), ext(11, ["i4,i4", b"12345678"]), ext(11, ["<M8[s]", b"12345678"]),
    ext(11, [5, b""]), ext(11, ["not a dtype", b""]), ext(11, ["<f4"]), ext(11, ["V4", b"1234"]),
    ext(12, {"module": 1}), ext(12, {}), ext(12, [1, 2, 3]),
    raw_ext(99, b""), raw_ext(2, b"\xc1"), raw_ext(2, b""), raw_ext(2, b"\x92\x01"),
    b"\xd4\xff\x00", b"\xd4\x80\x00",  # extension codes -1 (a malformed timestamp) and -128
    b"\x81\x91\x01\x02",  # a map whose key is an array (unhashable)
])
def test_hostile_extension_payloads(payload):
    with pytest.raises(ManifestError):
        decode_tree(payload, lambda index: torch.zeros(1) if index == 0 else (_ for _ in ()).throw(
            CheckpointError("out of range")))
    with pytest.raises(ManifestError):
        decode_tree(payload)  # no tensors allowed at all


def test_tensor_references_in_every_int_form():
    """A reference in one of msgpack's unsigned forms is read in place; a signed form (another writer's)
    still reads through the Unpacker; a payload with bytes after its int is refused either way."""
    def found(payload: bytes) -> int:
        return decode_tree(raw_ext(1, payload), lambda index: index)

    for index in (0, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32):
        assert found(msgpack.packb(index)) == index
    assert found(b"\xd1\x01\x00") == 256 and found(b"\xd0\x05") == 5
    for trailing in (b"\x05\x00", b"\xcc\x05\x00", b"\xcd\x01", b"\xcf" + bytes(9)):
        with pytest.raises(ManifestError):
            found(trailing)


def test_value_tree_must_be_bytes():
    for bad in ("text", bytearray(b"\xc0"), None, 5):
        with pytest.raises(ManifestError):
            decode_tree(bad)


# -- names and path traversal ------------------------------------------------------

BAD_NAMES = ["..", ".", "../x", "a/b", "", "x/..", "/abs", "chunks", "ckptfmt.json", "-lead", ".hidden",
             "a" * 129, "nul\x00", "ü", "a b", "a\\b"]


@pytest.mark.parametrize("name", BAD_NAMES + [5, None, b"bytes"])
def test_bad_names_are_refused_everywhere(tmp_path, name):
    with pytest.raises(InvalidNameError):
        check_name(name)
    repo_url = tmp_path / "repo"
    ckptfmt.save({}, repo_url / "ok")
    repo = Repository.open(repo_url)
    for call in (lambda: repo.commit(name), lambda: repo.manifest(name),
                 lambda: CheckpointReader.from_parts(repo, name), lambda: layout.commit_key(name)):
        with pytest.raises(InvalidNameError):
            call()


@pytest.mark.parametrize("name", ["..", "chunks", "ckptfmt.json", "-lead", ".hidden", "a" * 129, "a b", "ü"])
def test_save_and_load_refuse_bad_last_segments(repo_url, name):
    ckptfmt.save({"w": torch.zeros(1)}, f"{repo_url}/ok")
    before = open_storage(repo_url).list("")
    assert [e for e in before if not e.startswith("_")] == ["chunks", "ckptfmt.json", "ok"]  # and _index, _leases
    with pytest.raises(InvalidNameError):
        ckptfmt.save({"w": torch.ones(1)}, f"{repo_url}/{name}")
    with pytest.raises(InvalidNameError):
        ckptfmt.load(f"{repo_url}/{name}")
    assert Repository.open(repo_url).names() == ["ok"]
    assert open_storage(repo_url).list("") == before


def test_save_to_an_empty_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url in ("", "/"):
        with pytest.raises(InvalidNameError):
            ckptfmt.save({}, url)
    assert list(tmp_path.iterdir()) == []


def test_check_hash():
    assert check_hash("0" * 64) == "0" * 64
    for bad in ("../../x", "0" * 63, "0" * 65, "G" * 64, "A" * 64, None, 5, "0" * 63 + "\n"):
        with pytest.raises(InvalidNameError):
            check_hash(bad)
        with pytest.raises(InvalidNameError):
            layout.chunk_key(bad, "none")


# -- hostile commit records ------------------------------------------------------------


@pytest.fixture
def committed(tmp_path):
    repo = tmp_path / "repo"
    ckptfmt.save({"w": torch.arange(4)}, repo / "a", step=1)
    storage = open_storage(repo)
    return repo, storage, json.loads(storage.read(layout.commit_key("a"), max_size=ANY_SIZE))


@pytest.mark.parametrize("change, error", [
    ({"manifest": "../../x"}, InvalidNameError),
    ({"manifest": "../" * 21 + "x"}, InvalidNameError),
    ({"name": "../a"}, InvalidNameError),
    ({"name": "b"}, ManifestError),
    ({"parent": "a/b"}, InvalidNameError),
    ({"manifest_size": -1}, ManifestError),
    ({"manifest_size": 2**62}, ManifestError),
    ({"manifest_size": "100"}, ManifestError),
    ({"step": "1"}, ManifestError),
    ({"created_ns": 1.5}, ManifestError),
    ({"stats": [1]}, ManifestError),
    ({"format": "other"}, ManifestError),
    ({"version": "1.0"}, ManifestError),
    ({"version": [1]}, ManifestError),
    ({"version": [3, 0]}, UnsupportedVersionError),
    ({"version": [0, 9]}, UnsupportedVersionError),
])
def test_hostile_commit_records(committed, change, error):
    repo, storage, commit = committed
    storage.write(layout.commit_key("a"), json.dumps({**commit, **change}).encode())
    with pytest.raises(error) as info:
        ckptfmt.load(repo / "a")
    assert layout.commit_key("a") in str(info.value)
    report = ckptfmt.verify(repo)
    assert [(p.kind, p.checkpoint) for p in report.problems] == [("bad-checkpoint", "a")]


def test_commit_record_missing_fields(committed):
    repo, storage, commit = committed
    for field in ("manifest", "manifest_size", "created_ns", "name"):
        storage.write(layout.commit_key("a"), json.dumps({k: v for k, v in commit.items() if k != field}).encode())
        with pytest.raises(CheckpointError):
            ckptfmt.load(repo / "a")


def test_manifest_hash_pointing_elsewhere(committed):
    """A commit naming a valid-looking hash that is not the manifest's: refused, nothing read outside."""
    repo, storage, commit = committed
    storage.write(layout.commit_key("a"), json.dumps({**commit, "manifest": "0" * 64}).encode())
    with pytest.raises(CheckpointNotFoundError):
        ckptfmt.load(repo / "a")


# -- versions --------------------------------------------------------------------------


def test_newer_major_versions_are_refused(repo_url):
    state = {"w": torch.arange(4)}
    ckptfmt.save(state, f"{repo_url}/a")
    ckptfmt.save(state, f"{repo_url}/b")
    storage = open_storage(repo_url)

    rewrite_manifest(storage, "a", lambda d: d.update(version=[3, 0]))
    with pytest.raises(UnsupportedVersionError, match="written by a newer ckptfmt; upgrade to read it"):
        ckptfmt.load(f"{repo_url}/a")

    commit = json.loads(storage.read(layout.commit_key("b"), max_size=ANY_SIZE))
    storage.write(layout.commit_key("b"), json.dumps({**commit, "version": [3, 1]}).encode())
    with pytest.raises(UnsupportedVersionError):
        ckptfmt.load(f"{repo_url}/b")

    storage.write(layout.MARKER_KEY, json.dumps({"format": "ckptfmt-repository", "version": [3, 0]}).encode())
    for call in (lambda: Repository.open(repo_url), lambda: ckptfmt.load(repo_url),
                 lambda: ckptfmt.save(state, f"{repo_url}/c"), lambda: ckptfmt.verify(repo_url)):
        with pytest.raises(UnsupportedVersionError):
            call()
    assert json.loads(storage.read(layout.MARKER_KEY, max_size=ANY_SIZE))["version"] == [3, 0]  # not overwritten
    assert not storage.exists(layout.commit_key("c"))


def test_newer_minor_versions_with_unknown_fields_are_read(repo_url):
    state = {"w": torch.arange(300_000, dtype=torch.int8), "v": {"x": (1, 2)}}
    ckptfmt.save(state, f"{repo_url}/a", step=4)
    storage = open_storage(repo_url)

    def future(doc):
        doc["version"] = [1, 9]
        doc["future_field"] = {"hello": [1, 2]}
        for tensor in doc["tensors"]:
            tensor["future_tensor_field"] = "x"
            for shard in tensor["shards"]:
                shard["future_shard_field"] = 1
        for chunk in doc["chunks"]:
            chunk["future_chunk_field"] = True

    rewrite_manifest(storage, "a", future)
    commit = json.loads(storage.read(layout.commit_key("a"), max_size=ANY_SIZE))
    storage.write(layout.commit_key("a"), json.dumps({**commit, "version": [1, 9], "signature": "abc"}).encode())
    storage.write(layout.MARKER_KEY, json.dumps({"format": "ckptfmt-repository", "version": [1, 3],
                                                 "features": ["x"]}).encode())
    assert_same(state, ckptfmt.load(f"{repo_url}/a"))
    meta = ckptfmt.open(f"{repo_url}/a").metadata
    assert meta["format_version"] == [1, 9]
    assert meta["extra"] == {"future_field": {"hello": [1, 2]}}
    assert meta["step"] == 4
    assert ckptfmt.verify(repo_url).ok
    ckptfmt.save(state, f"{repo_url}/b")  # an older writer may add to a newer-minor repository
    assert_same(state, ckptfmt.load(f"{repo_url}/b"))


# -- hostile data past the parser ------------------------------------------------------


HOSTILE_CONTENT = {
    # id: (change to the manifest document, the entry point that must refuse it)
    # numpy lacks bfloat16; the statistics of a float dtype (spec 6.10: an int16 array has the integer set)
    "numpy-bfloat16": (lambda d: find_tensor(d, "array").update(dtype="bfloat16", stats={"count": 5}), "load"),
    "int-parameter-grad": (lambda d: find_tensor(d, "big").update(kind="parameter", requires_grad=True), "load"),
    "rng-huge-int": (lambda d: [r.update(torch_cpu=2**62) for r in d["rng"]], "restore_rng"),  # no bytearray(2**62)
    "rng-numpy-overflow": (lambda d: [r["numpy"].update(pos=2**64 - 1) for r in d["rng"]], "restore_rng"),
    "rng-python": (lambda d: [r.update(python={"version": 3, "state": 5, "gauss_next": None}) for r in d["rng"]],
                   "restore_rng"),
    "rng-cuda": (lambda d: [r.update(cuda=7) for r in d["rng"]], "restore_rng"),
    "state-bad-ref": (lambda d: d.update(state=ext(1, 99)), "load"),  # a tensor reference past the table
    "user-garbage": (lambda d: d.update(user=b"\xc1"), "metadata"),
    "codec-traversal": (lambda d: d["chunks"][0].update(codec="../../../etc/passwd"), "parse"),
    "codec-unknown": (lambda d: d["chunks"][0].update(codec="lz4"), "parse"),
    "stored-size": (lambda d: d["chunks"][0].update(stored_size=0), "parse"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_CONTENT))
def test_consistent_but_hostile_manifests(victim, case):
    """Manifests whose content a reader must refuse cleanly: at parse time, or when the bad part is used."""
    change, refuser = HOSTILE_CONTENT[case]
    repo_url, data = victim
    doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    doc["tensors"], doc["chunks"] = tensor_rows(doc["tensors"]), chunk_rows(doc["chunks"])
    change(doc)
    new = msgpack.packb(doc, use_bin_type=True)
    if refuser == "parse":
        with pytest.raises(ManifestError):
            Manifest.from_bytes(new, "x")
        return
    Manifest.from_bytes(new, "x")  # the parser accepts these
    url = install(repo_url, new, NAME)
    entry_points = {
        "load": lambda: ckptfmt.load(url),
        "restore_rng": lambda: ckptfmt.restore_rng(url),
        "metadata": lambda: ckptfmt.open(url).metadata,
    }
    try:
        with generators_kept():
            with pytest.raises(CheckpointError):
                entry_points.pop(refuser)()
            call_each_allowing_checkpoint_errors(entry_points.values())
    finally:
        install(repo_url, data, NAME)  # leave the module's victim intact


# -- duplicate keys: two readers must never disagree on which value wins ------------------------


def test_duplicate_map_keys_are_refused_everywhere(victim, base_bytes):
    doc = msgpack.unpackb(base_bytes[1], raw=False, strict_map_key=False)
    pairs = list(doc.items()) + [("name", "other")]
    with pytest.raises(ManifestError, match="'name' twice"):
        Manifest.from_bytes(msgpack.Packer(use_bin_type=True).pack_map_pairs(pairs), "m")
    inner = msgpack.Packer().pack_map_pairs([("x", 1), ("x", 2)])
    with pytest.raises(ManifestError, match="'x' twice"):
        decode_tree(inner)
    record = b'{"format": "ckptfmt-commit", "format": "ckptfmt-commit", "version": [1, 0]}'
    with pytest.raises(ManifestError, match="'format' twice"):
        CommitRecord.from_bytes(record, "COMMIT")


@pytest.mark.parametrize("section, field, value, refusal", [
    ("numpy", "keys", b"short", "numpy's keys must be a bin of 2496 bytes .624 uint32., not 5 bytes"),
    # an empty key made numpy's set_state raise IndexError, past the CheckpointError net (`make fuzz`)
    ("numpy", "keys", b"", "numpy's keys must be a bin of 2496 bytes .624 uint32., not 0 bytes"),
    ("numpy", "keys", b"\x00" * 2500, "numpy's keys must be a bin of 2496 bytes .624 uint32., not 2500 bytes"),
    ("numpy", "keys", "a string", "numpy's keys must be a bin of 2496 bytes .624 uint32., not a str"),
    ("numpy", "pos", 10**6, r"numpy's pos must be an int in \[0, 624\], not 1000000"),  # numpy: crashed on a draw
    ("numpy", "pos", -1, r"numpy's pos must be an int in \[0, 624\], not -1"),
    ("numpy", "pos", 1.5, r"numpy's pos must be an int in \[0, 624\], not a float"),
    ("numpy", "has_gauss", 5, "numpy's has_gauss must be 0 or 1, not 5"),
    ("numpy", "bit_generator", "PCG64", "numpy's bit_generator must be 'MT19937' .its legacy state., not 'PCG64'"),
    ("numpy", "cached_gaussian", "x", "numpy's cached_gaussian must be a float, not a str"),
    ("python", "gauss_next", "x", "python's gauss_next must be a float or nil, not a str"),  # random takes it
])
def test_a_malformed_rng_entry_leaves_every_generator_as_it_was(tmp_path, section, field, value, refusal):
    """torch's state is valid and numpy's or Python's is not: restore_rng fails, naming what is wrong, and no
    generator is touched (numpy itself accepts a position past its key and reads there on its next draw)."""
    ckptfmt.save({"w": torch.ones(2)}, tmp_path / "repo" / "a")
    rewrite_manifest(open_storage(tmp_path / "repo"), "a", lambda d: d["rng"][0][section].update({field: value}))
    with generators_kept():
        torch.manual_seed(123)
        np.random.seed(7)
        random.seed(9)
        before = torch.get_rng_state(), np.random.get_state(), random.getstate()
        with pytest.raises(CheckpointError, match=f"malformed RNG state .{refusal}"):
            ckptfmt.restore_rng(tmp_path / "repo" / "a", rank=0)
        assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[2]
        after = np.random.get_state()
        assert after[2:] == before[1][2:] and np.array_equal(after[1], before[1][1])


def test_a_deeply_nested_value_where_a_string_belongs_is_quoted_briefly(tmp_path):
    """A chunk row's hash that is a list nested 1000 deep, found by `make fuzz`: quoting it in
    the error message with repr() recursed out (RecursionError) in every reader."""
    url = ckptfmt.save({"w": torch.ones(4)}, tmp_path / "repo" / "a")
    placeholder = "NESTED-VALUE-PLACEHOLDER"
    nested = b"\x91" * 1000 + b"\xc0"  # [[[...[None]...]]], deeper than repr() can go
    rewrite_manifest(open_storage(tmp_path / "repo"), "a",
                     lambda doc: doc["chunks"][0].update(hash=placeholder),
                     patch=lambda data: data.replace(msgpack.packb(placeholder), nested))
    with pytest.raises(ckptfmt.CheckpointError, match=r"\[\[\[\[\.\.\.\]\]\]\]") as info:
        ckptfmt.open(url)
    assert len(str(info.value)) < 1000


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_damaged_chunk_is_named_with_its_tensor_on_load(tmp_path, mmap, damage):
    """load, get_tensor and load(into=...) say which checkpoint, tensor and chunk, as verify does."""
    url = str(tmp_path / "repo" / "s1")
    ckptfmt.save({"model": {"w": torch.randn(1000), "b": torch.randn(10)}}, url)
    (chunk,) = (tmp_path / "repo" / "chunks").glob("*/*")
    if damage == "flip":
        data = bytearray(chunk.read_bytes())
        data[5] ^= 1
        chunk.write_bytes(bytes(data))
    else:
        chunk.unlink()
    error = ckptfmt.CorruptDataError if damage == "flip" else ckptfmt.CheckpointNotFoundError
    expected = rf"^{url}: tensor 'model/w': {chunk}: " + ("hash mismatch" if damage == "flip" else "chunk is missing")
    with pytest.raises(error, match=expected):
        ckptfmt.load(url, mmap=mmap)
    with pytest.raises(error, match=expected), ckptfmt.open(url, mmap=mmap) as reader:
        reader.get_tensor("model/w")
    with pytest.raises(error, match=rf"^{url}: tensor 'model/(w|b)': {chunk}"):
        ckptfmt.load(url, into={"model": {"w": torch.zeros(1000), "b": torch.zeros(10)}})
