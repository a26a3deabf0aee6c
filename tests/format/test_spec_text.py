"""spec/: what the text of FORMAT.md and ANALYTICS.md states agrees with what ckptfmt writes and reads.

A reader written from spec/ alone found where text and bytes disagreed (issue 19). Each test
here takes a statement or example of the text, parsed from the text itself, and checks it
against real files that ``ckptfmt.save`` wrote, or against what ``ckptfmt.load`` accepts:

* the version the text names is the one written; the changelog runs oldest first;
* every JSON example of FORMAT.md validates against its schema, and so do real markers,
  commit records, manifests, index packs, index entries and leases;
* the worked example (section 16) is what a real save of its state writes;
* the rules the text states (reserved names in any case, key bytes, nil, map key sameness,
  tensors never in keys, the nesting depth, numpy scalar type strings, shard ranks, codecs,
  how shards are packed) hold in the writer and the reader;
* every section heading says who needs it, as the reading guide at the top lists;
* what a second reader of 1.6 found (issue 27): every chunk a delta save stores has a key of
  section 4.1's grammar, base rows need no piece, packs are never deltas, a grid's ``length``
  comes exactly with its ``counts``, the statistics sets of each dtype are section 6.10's table,
  a zero extreme's sign does not depend on order or cut, a ``same_as`` entry's statistics are
  checked and not used, section 14 bounds and checks every top-level map (from the schema) and
  bounds piece offsets as 6.11 does; no version range ends before this version, and every
  cross-reference names a section, step, version or file that exists.
"""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import blake3
import msgpack
import numpy as np
import pytest
import torch

from tests.support.helpers import require_module, rewrite_manifest

jsonschema = require_module("jsonschema")
referencing = require_module("referencing")

import ckptfmt
from ckptfmt import analytics
from ckptfmt.errors import InvalidNameError, ManifestError, UnsupportedValueError
from ckptfmt.format import values
from ckptfmt.format.manifest import FORMAT_VERSION
from ckptfmt.repository.repository import Repository
from tests.support.spec_reader import (
    SpecReader,
    chunk_rows,
    json_image,
    shard_maps,
    store_chunk,
    tensor_rows,
    write_by_spec,
)

SPEC = Path(__file__).resolve().parents[2] / "spec"
FORMAT = (SPEC / "FORMAT.md").read_text(encoding="utf-8")
#: The list of versions, oldest first (moved out of FORMAT.md at 2.0).
CHANGES = (SPEC / "CHANGES.md").read_text(encoding="utf-8")
MARKERS = ("readers", "writers", "optional")
_HEADING = re.compile(r"^(#{2,3}) (\d+)(?:\.(\d+))?\.? (.*)$", re.M)


# -- reading the text ----------------------------------------------------------------------

def section(number: str) -> str:
    """The text of section ``number`` ("6" or "6.5"): from its heading to the next heading of its level or above."""
    headings = list(_HEADING.finditer(FORMAT))
    for i, match in enumerate(headings):
        if ".".join(filter(None, match.group(2, 3))) == number:
            level = len(match.group(1))
            end = next((h.start() for h in headings[i + 1:] if len(h.group(1)) <= level), len(FORMAT))
            return FORMAT[match.start():end]
    raise KeyError(f"no section {number}")


def code_blocks(text: str, *languages: str) -> list[str]:
    """The bodies of the fenced code blocks of ``text`` in ``languages`` ('' for blocks without one)."""
    found = []
    for match in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, re.M | re.S):
        if match.group(2) in languages:
            indent = len(match.group(1))
            found.append("".join(line[indent:] for line in match.group(3).splitlines(keepends=True)))
    return found


def _strip_comments(text: str) -> str:
    """JSON with comments (// and /* */, outside strings) -> JSON."""
    out, i, in_string = [], 0, False
    while i < len(text):
        char = text[i]
        if in_string:
            out.append(char)
            if char == "\\":
                out.append(text[i + 1])
                i += 1
            elif char == '"':
                in_string = False
        elif text.startswith("//", i):
            i = text.find("\n", i) - 1 if "\n" in text[i:] else len(text)
        elif text.startswith("/*", i):
            i = text.index("*/", i) + 1
        else:
            in_string = char == '"'
            out.append(char)
        i += 1
    return "".join(out)


def parse_example(text: str) -> dict:
    """A JSON example of FORMAT.md, comments removed and its elisions (section 16) resolved:
    an array item ``...`` stands for items left out, ``"..."`` for a string or a $bin's base64."""
    text = re.sub(r",\s*\.\.\.(?=\s*\])", "", _strip_comments(text))
    text = text.replace('{"$bin": "..."}', '{"$bin": ""}')
    return json.loads(text)


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of the Markdown tables in ``text``, by the name in their first cell (backquotes removed)."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = cells[1:]
    return rows


# -- schemas -------------------------------------------------------------------------------

def _validators() -> dict[str, jsonschema.Draft202012Validator]:
    """Every schema of spec/, by its file name, each able to refer to the others by their $id."""
    schemas = {path.name: json.loads(path.read_text(encoding="utf-8")) for path in SPEC.glob("*.schema.json")}
    registry = referencing.Registry().with_resources(
        (schema["$id"], referencing.Resource.from_contents(schema)) for schema in schemas.values())
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    return {name: jsonschema.Draft202012Validator(schema, registry=registry) for name, schema in schemas.items()}


VALIDATORS = _validators()
SCHEMA_OF_FORMAT = {
    "ckptfmt-manifest": "manifest.schema.json", "ckptfmt-commit": "commit.schema.json",
    "ckptfmt-repository": "repository.schema.json", "ckptfmt-index-pack": "index-pack.schema.json",
    "ckptfmt-lease": "lease.schema.json", "ckptfmt-copy": "copy.schema.json",
}


def validate(document: dict) -> None:
    VALIDATORS[SCHEMA_OF_FORMAT[document["format"]]].validate(document)


# -- real files ----------------------------------------------------------------------------

def _files(root: Path) -> dict[str, bytes]:
    return {f"REPO/{path.relative_to(root).as_posix()}": path.read_bytes()
            for path in root.rglob("*") if path.is_file()}


def _manifest_doc(repo: Path, name: str, *, rows: bool = True) -> tuple[dict, bytes]:
    """A checkpoint's manifest document and bytes; with ``rows``, its tensor and chunk tables as one map per
    entry (sections 6.4 and 6.3) whichever form they were written in."""
    commit = json.loads((repo / name / "COMMIT").read_bytes())
    data = (repo / name / f"manifest-{commit['manifest']}.msgpack").read_bytes()
    doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if rows:
        doc["tensors"], doc["chunks"] = tensor_rows(doc["tensors"]), chunk_rows(doc["chunks"])
    return doc, data


WORKED_STATE = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "step": 3}


@pytest.fixture(scope="module")
def worked_example(tmp_path_factory):
    """Section 16's save, made for real; the lease file is captured while the save holds it."""
    repo = tmp_path_factory.mktemp("worked") / "repo"
    leases = []
    ckptfmt.save(WORKED_STATE, f"{repo}/step-3", step=3, metadata={"lr": 0.001},
                 before_commit=lambda: leases.extend(p.read_bytes() for p in (repo / "_leases").iterdir()))
    assert len(leases) == 1
    return repo, leases[0]


# -- the version --------------------------------------------------------------------------

def _version_text(version) -> str:
    return f"`[{version[0]}, {version[1]}]`"


def test_the_version_the_text_names_is_the_version_written(worked_example):
    repo, lease = worked_example
    major, minor = FORMAT_VERSION
    title = re.match(r"# The ckptfmt checkpoint format, version (\d+)\.(\d+)\n", FORMAT)
    assert (int(title[1]), int(title[2])) == FORMAT_VERSION
    assert f"This document is version **{major}.{minor}**" in section("13")
    assert f"(ckptfmt: {_version_text(FORMAT_VERSION)})" in section("13")
    # Every table row that describes a `version` member names this version and no other.
    version_rows = [line for line in FORMAT.splitlines() if line.startswith("| `version` |")]
    assert len(version_rows) == 8  # manifest, commit record, marker, signature, lease, copy record, parity
    # record, node parity record
    # record (the index pack's is in prose)
    for row in version_rows:
        assert re.findall(r"`\[\d+, \d+\]`", row) == [_version_text(FORMAT_VERSION)], row
    assert f"`version` ({_version_text(FORMAT_VERSION)} for" in section("4.4")

    manifest, _ = _manifest_doc(repo, "step-3")
    written = [json.loads((repo / "ckptfmt.json").read_bytes()), json.loads((repo / "step-3" / "COMMIT").read_bytes()),
               manifest, json.loads(lease)]
    assert [tuple(doc["version"]) for doc in written] == [FORMAT_VERSION] * 4

    analytics_doc = (SPEC / "ANALYTICS.md").read_text(encoding="utf-8")
    row = table_rows(analytics_doc)["format_version"]
    assert f'`"{major}.{minor}"` for checkpoints of this format version' in row[1]
    assert analytics.tables(str(repo))["checkpoints"].column("format_version").to_pylist() == [f"{major}.{minor}"]


def test_the_changelog_runs_oldest_first_up_to_this_version():
    versions = CHANGES
    found = [(int(m[2]), int(m[3]), int(m[1] or 1))
             for m in re.finditer(r"^- \*\*(?:Revision (\d+) of |Version )(\d+)\.(\d+)\*\*", versions, re.M)]
    assert len(found) >= 5 and found == sorted(found) and len(set(found)) == len(found)
    assert found[-1][:2] == FORMAT_VERSION


# -- examples and real files against the schemas ----------------------------------------

def test_every_json_example_of_the_text_validates_against_its_schema():
    examples = [parse_example(block) for block in code_blocks(FORMAT, "json", "jsonc")]
    formats = [example["format"] for example in examples]
    assert set(formats) == set(SCHEMA_OF_FORMAT), formats  # every kind of JSON file has an example
    for example in examples:
        validate(example)
        assert not VALIDATORS[SCHEMA_OF_FORMAT[example["format"]]].is_valid({**example, "version": [3, 0]})
        if example["format"] == "ckptfmt-manifest":  # elided, the example still names tensors, chunks, a state
            assert example["tensors"] and example["chunks"] and example["state"]["$bin"]


def test_real_files_of_every_kind_validate_against_the_schemas(tmp_path):
    repo = tmp_path / "repo"
    leases = []

    def capture_lease():
        leases.extend(json.loads(p.read_bytes()) for p in (repo / "_leases").iterdir())
    ckptfmt.save({"w": torch.arange(6.0)}, f"{repo}/a", step=1)
    ckptfmt.save({"w": torch.arange(7.0), "n": 2}, f"{repo}/b", step=2, before_commit=capture_lease)
    entries = sorted((repo / "_index" / "e").iterdir())
    assert [p.stat().st_size for p in entries] == [0, 0]  # index entries are empty files (4.4), no JSON to validate
    entry_key = re.compile(r"[0-9]{19}\.[A-Za-z0-9][A-Za-z0-9._-]{0,127}\.[0-9a-f]{64}")
    for path, name in zip(entries, ["a", "b"]):
        assert entry_key.fullmatch(path.name) and path.name.split(".")[1] == name
    assert Repository.open(str(repo)).rebuild_index() == 2  # a real pack of both commit records
    packs = list((repo / "_index" / "p").iterdir())
    assert len(packs) == 1 and re.fullmatch(r"[0-9]{10}\.00000002\.[0-9]{19}\.[0-9a-f]{8}\.json", packs[0].name)

    documents = [json.loads((repo / "ckptfmt.json").read_bytes()), json.loads(packs[0].read_bytes()), *leases]
    for name in ("a", "b"):
        documents.append(json.loads((repo / name / "COMMIT").read_bytes()))
        documents.append(json_image(_manifest_doc(repo, name)[0]))
    assert sorted(doc["format"] for doc in documents) == sorted(
        ["ckptfmt-repository", "ckptfmt-index-pack", "ckptfmt-lease"] + ["ckptfmt-commit", "ckptfmt-manifest"] * 2)
    for document in documents:
        validate(document)
    pack = documents[1]
    assert [r["name"] for r in pack["records"]] == ["a", "b"]
    forged = {**pack, "records": [{**pack["records"][0], "name": "../x"}]}
    assert not VALIDATORS["index-pack.schema.json"].is_valid(forged)
    assert not VALIDATORS["lease.schema.json"].is_valid({**leases[0], "kind": "other"})


# -- the worked example (section 16) -------------------------------------------------------

def test_the_worked_example_is_what_a_real_save_writes(worked_example):
    repo, _ = worked_example
    text = section("16")
    listing, chunk_block = code_blocks(text, "")[:2]
    example_manifest = parse_example(code_blocks(text, "jsonc")[0])
    example_commit, example_marker = (parse_example(block) for block in code_blocks(text, "json"))
    real_commit = json.loads((repo / "step-3" / "COMMIT").read_bytes())
    real_manifest, manifest_bytes = _manifest_doc(repo, "step-3", rows=False)

    # The files, with this save's manifest hash and time in place of the example's.
    expected = listing.replace(example_commit["manifest"], real_commit["manifest"])
    expected = expected.replace(str(example_commit["created_ns"]), f"{real_commit['created_ns']:019d}")
    files = _files(repo)
    assert set(expected.split()) == set(files)
    assert [files[key] for key in files if "/_index/e/" in key] == [b""]
    assert [p.name for p in repo.iterdir() if p.is_dir() and not any(p.iterdir())] == ["_leases"]

    # The chunk: its bytes and hash as shown.
    hex_line, _, hash_line = chunk_block.splitlines()[:3]
    chunk_hash = hash_line.split("=")[1].strip()
    assert files[f"REPO/chunks/{chunk_hash[:2]}/{chunk_hash}"] == bytes.fromhex(hex_line)

    # The manifest: the same fields in the same order, equal where a save does not vary.
    image = json_image(real_manifest)
    assert list(example_manifest) == list(image)
    for field in ("format", "version", "name", "step", "parent", "chunks", "tensors", "state", "user", "stats"):
        assert example_manifest[field] == image[field], field
    assert list(example_manifest["rng"][0]) == list(image["rng"][0])
    assert list(example_manifest["environment"]) == list(image["environment"])
    assert list(example_manifest["topology"]) == list(image["topology"])
    example_phases, real_phases = ([[p["name"] for p in rank["phases"]] for rank in doc["timing"]["ranks"]]
                                   for doc in (example_manifest, image))
    assert example_phases == real_phases
    # The msgpack bytes its comments spell out, and the first bytes of the file.
    state_bytes, user_bytes = (bytes.fromhex(h) for h in re.findall(r"msgpack bytes ((?:[0-9a-f]{2} ?)+)", text))
    assert state_bytes == real_manifest["state"] == base64.b64decode(example_manifest["state"]["$bin"])
    assert user_bytes == real_manifest["user"] == base64.b64decode(example_manifest["user"]["$bin"])
    begins = re.search(r"it begins\s+`((?:[0-9a-f]{2} )+)\.\.\.`", text)[1]
    assert manifest_bytes.startswith(bytes.fromhex(begins))

    # The commit record and the marker.
    assert list(example_commit) == list(real_commit)
    assert {k: example_commit[k] for k in ("name", "step", "parent", "stats")} == {
        k: real_commit[k] for k in ("name", "step", "parent", "stats")}
    assert example_marker == json.loads((repo / "ckptfmt.json").read_bytes())

    # The example pack of 4.4 holds the commit record of this example.
    pack = next(parse_example(b) for b in code_blocks(section("4.4"), "json"))
    assert pack["records"] == [example_commit]


# -- names and keys: the schemas against the prose ----------------------------------------

def test_reserved_names_are_refused_in_any_letter_case(worked_example, tmp_path):
    repo, _ = worked_example
    commit = json.loads((repo / "step-3" / "COMMIT").read_bytes())
    image = json_image(_manifest_doc(repo, "step-3")[0])
    assert "compared\n  case-insensitively" in section("4.2")
    for name in ("chunks", "Chunks", "CHUNKS", "ckptfmt.json", "Ckptfmt.JSON", "CKPTFMT.JSON"):
        for schema, document in (("commit.schema.json", {**commit, "name": name}),
                                 ("commit.schema.json", {**commit, "parent": name}),
                                 ("manifest.schema.json", {**image, "name": name}),
                                 ("index-pack.schema.json", {"format": "ckptfmt-index-pack", "version": [1, 3],
                                                             "records": [{**commit, "name": name}]})):
            assert not VALIDATORS[schema].is_valid(document), (schema, name)
        with pytest.raises(InvalidNameError):
            ckptfmt.save({}, f"{tmp_path}/repo/{name}")
    for name in ("chunks2", "my-chunks", "ckptfmt.jsonx", "Chunk"):
        assert VALIDATORS["commit.schema.json"].is_valid({**commit, "name": name}), name
        ckptfmt.save({}, f"{tmp_path}/repo/{name}")


def test_key_length_is_bytes_in_the_prose_and_a_character_bound_in_the_schema(tmp_path):
    key_schema = json.loads((SPEC / "manifest.schema.json").read_text())["$defs"]["tensor"]["properties"]["key"]
    assert "counts characters, not bytes" in key_schema["description"]
    assert "1 to 4096 UTF-8 bytes" in table_rows(section("6.4"))["key"][1]
    repo = tmp_path / "repo"
    longest = "é" * 2048  # 2048 characters, 4096 bytes: the longest valid key of this letter
    ckptfmt.save({longest: torch.ones(2)}, f"{repo}/ok")
    manifest, _ = _manifest_doc(repo, "ok")
    validate(json_image(manifest))
    assert torch.equal(ckptfmt.load(f"{repo}/ok")[longest], torch.ones(2))
    assert SpecReader(repo, "ok").tensor_bytes(longest)[1] == torch.ones(2).numpy().tobytes()

    with pytest.raises(UnsupportedValueError, match="longer than 4096 bytes"):
        ckptfmt.save({longest + "é": torch.ones(2)}, f"{repo}/long")
    storage = Repository.open(str(repo)).storage
    for key, schema_accepts in (("é" * 2049, True), ("a" * 4097, False)):  # 4098 bytes; 4097 characters
        ckptfmt.save({"k": torch.ones(2)}, f"{repo}/{len(key)}")
        rewrite_manifest(storage, str(len(key)), lambda doc, key=key: doc["tensors"][0].update(key=key))
        manifest, _ = _manifest_doc(repo, str(len(key)))
        assert VALIDATORS["manifest.schema.json"].is_valid(json_image(manifest)) is schema_accepts
        with pytest.raises(ManifestError, match="invalid key"):
            ckptfmt.open(f"{repo}/{len(key)}")


# -- nil below the top level (6.1) --------------------------------------------------------

def test_nil_is_allowed_only_where_the_tables_say_so(tmp_path):
    repo = tmp_path / "repo"
    storage = Repository.open(str(repo), create=True).storage
    nil_paragraph = section("6.1")[section("6.1").index("**Nil.**"):]
    optional = {}  # field -> (where in the manifest, whether the table allows nil)
    for table, where in (("6.3", "chunk"), ("6.4", "tensor"), ("6.5", "shard")):
        for field, (required, kind, *_) in table_rows(section(table)).items():
            if required == "no":
                optional[field] = (where, "or nil" in kind)
                assert ("not nil" in kind) is not optional[field][1], field
                assert f"`{field}`" in nil_paragraph, field
    assert optional == {"kind": ("tensor", False), "requires_grad": ("tensor", False), "same_as": ("tensor", True),
                        "stats": ("tensor", False), "rank": ("shard", False)}
    for field, (where, allowed) in optional.items():
        name = f"nil-{field}".replace("_", "-")
        ckptfmt.save({"w": torch.ones(2)}, f"{repo}/{name}")

        def set_nil(doc, field=field, where=where):
            tensor = doc["tensors"][0]
            (tensor["shards"][0] if where == "shard" else tensor)[field] = None
        rewrite_manifest(storage, name, set_nil)
        assert VALIDATORS["manifest.schema.json"].is_valid(json_image(_manifest_doc(repo, name)[0])) is allowed
        if allowed:
            assert torch.equal(ckptfmt.load(f"{repo}/{name}")["w"], torch.ones(2))
        else:
            with pytest.raises(ManifestError, match=field):
                ckptfmt.open(f"{repo}/{name}")


# -- the value tree: sameness, keys, nesting, extensions (7) -------------------------------

def _ext(code: int, body) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(body, use_bin_type=True))


def _two_keys(first, second) -> bytes:
    """A msgpack map with two entries, the keys as given (a Python dict could not hold some pairs)."""
    pack = msgpack.Packer(use_bin_type=True).pack
    return b"\x82" + pack(first) + pack("x") + pack(second) + pack("y")


@pytest.fixture
def state_checkpoint(tmp_path):
    """A function that makes a msgpack value tree the state of a real checkpoint (whose tensor 0 is [1, 2])
    and loads it."""
    url = f"{tmp_path}/repo/c"
    ckptfmt.save({"t": torch.tensor([1.0, 2.0])}, url)
    storage = Repository.open(f"{tmp_path}/repo").storage

    def load(tree: bytes):
        rewrite_manifest(storage, "c", lambda doc: doc.update(state=tree))
        return ckptfmt.load(url)
    return load


NAN = float("nan")
SAME_KEYS = [
    (1, True), (1, 1.0), (1, _ext(7, [1.0, 0.0])), (1, _ext(11, ["|i1", b"\x01"])), (0.0, -0.0),
    (1, msgpack.ExtType(3, b"1")),  # a big-int payload in range is still the int
    (_ext(2, [1, 2]), _ext(9, [1, 2])), (_ext(2, [1, 2]), _ext(2, [True, 2.0])), (_ext(6, [1, 2]), _ext(6, [2, 1])),
    (_ext(8, "float32"), _ext(8, "float32")), (_ext(10, "cpu"), _ext(10, "cpu")),
    (_ext(12, {"module": "m", "qualname": "q", "pickle": b"p"}),
     _ext(12, {"module": "m", "qualname": "q", "pickle": b"p"})),
]
DIFFERENT_KEYS = [
    ("a", b"a"), (NAN, NAN), (_ext(11, ["<f4", np.float32(0.1).tobytes()]), 0.1), ("1", 1), (None, False),
    (_ext(2, [1]), _ext(6, [1])), (_ext(2, [NAN]), _ext(2, [NAN])), (_ext(10, "cuda"), _ext(10, "cuda:0")),
    ("e\u0301", "\u00e9"),  # no Unicode normalization
]


def test_map_keys_are_the_same_when_their_values_are_equal(state_checkpoint):
    text = section("7.1")
    assert "**Sameness.**" in text and "`1`, `true`, `1.0`" in text and "`0.0` and `-0.0`" in text
    assert "not\n  even another NaN" in text
    for first, second in SAME_KEYS:
        with pytest.raises(ManifestError, match="twice"):
            state_checkpoint(_two_keys(first, second))
    for first, second in DIFFERENT_KEYS:
        assert len(state_checkpoint(_two_keys(first, second))) == 2, (first, second)


def test_a_set_may_not_hold_an_item_twice(state_checkpoint):
    for code, kind in ((5, set), (6, frozenset)):
        for items in ([1, True], [1, 1.0], [0.0, -0.0], [_ext(2, [1]), _ext(9, [1])]):
            with pytest.raises(ManifestError, match="twice"):
                state_checkpoint(msgpack.packb(_ext(code, items), use_bin_type=True))
        loaded = state_checkpoint(msgpack.packb(_ext(code, [NAN, NAN, 1, "1"]), use_bin_type=True))
        assert type(loaded) is kind and len(loaded) == 4


def test_a_tensor_is_never_in_a_map_key_or_set_item(state_checkpoint, tmp_path):
    assert "<key>" not in section("6.7") and "never inside a map key or set item" in section("6.7")
    tensor = torch.ones(2)
    for state in ({(tensor,): 1}, {(1, (tensor,)): 1}, {"s": frozenset({(tensor,)})}, {tensor: 1}):
        with pytest.raises(UnsupportedValueError, match="tensors cannot be dict keys or set items"):
            ckptfmt.save(state, f"{tmp_path}/refused/x")
    ref = _ext(1, 0)
    for tree in ({ref: 1}, {_ext(2, [1, ref]): 1}, {_ext(2, [_ext(2, [ref])]): 1}, _ext(6, [ref]),
                 _ext(5, [_ext(2, [ref])]), {_ext(13, {0: 1}): 1}, {_ext(4, {}): 1}):
        with pytest.raises(ManifestError, match="invalid (map key|set item)"):
            state_checkpoint(msgpack.packb(tree, use_bin_type=True))
    plain_key = state_checkpoint(msgpack.packb({"t": ref, _ext(2, [1, "a"]): ref}, use_bin_type=True))
    assert plain_key["t"].tolist() == [1, 2] and plain_key[(1, "a")] is plain_key["t"]


def _nested_tuples(depth: int, leaf):
    for _ in range(depth):
        leaf = (leaf,)
    return leaf


def test_per_rank_values_count_in_the_nesting_depth(tmp_path):
    """A per-rank map is a container (7.4): the writer refuses what the reader would refuse."""
    assert "the\nvalues of a per-rank map (13) are one deeper" in section("7.4")
    assert "The root (the whole `state` or `user`\ndocument) has depth 0" in section("7.4")
    deepest = _nested_tuples(255, ckptfmt.PerRank(1 + 2j))  # the per-rank map at 255, its value at 256
    ckptfmt.save(deepest, f"{tmp_path}/repo/deepest")
    loaded = ckptfmt.load(f"{tmp_path}/repo/deepest")
    for _ in range(255):
        (loaded,) = loaded
    assert loaded == ckptfmt.PerRankValues({0: 1 + 2j})
    with pytest.raises(UnsupportedValueError, match="nested deeper than 256"):
        ckptfmt.save(_nested_tuples(256, ckptfmt.PerRank(1 + 2j)), f"{tmp_path}/repo/too-deep")


def _listed_typestrs() -> set[str]:
    """The numpy scalar type strings section 7.2 lists (with `>` wherever it says "the same with `>`")."""
    text = section("7.2")
    paragraph = text[text.index("**Numpy scalars (11).**"):text.index("**Opaque objects (12).**")]
    listed = paragraph[:paragraph.index("Readers MUST refuse")]
    names = set(re.findall(r"`([<>|][biufc]\d+)`", listed))
    little = {name for name in names if name[0] == "<" and name not in ("<f16", "<c32")}
    assert "and the same with\n`>` (big-endian)" in listed
    return names | {">" + name[1:] for name in little}


def test_numpy_scalar_type_strings_are_those_the_text_lists(state_checkpoint, tmp_path):
    long_double = np.finfo(np.longdouble)
    x87 = long_double.nmant == 63 and long_double.dtype.str == "<f16"  # x87 extended precision in 16 bytes
    refused = [("f4", bytes(4)), ("=f4", bytes(4)), ("l", bytes(8)), ("float32", bytes(4)), ("<f12", bytes(12)),
               ("<m8", bytes(8)), ("|b1", b"\x02"), ("<f4", bytes(5)), ("|i1", b"")]
    if not x87:
        refused += [("<f16", bytes(16)), ("<c32", bytes(32))]
    for typestr, raw in refused:
        with pytest.raises(ManifestError, match="numpy scalar"):
            state_checkpoint(msgpack.packb(_ext(11, [typestr, raw]), use_bin_type=True))
    with pytest.raises(ManifestError):  # exactly two items
        state_checkpoint(msgpack.packb(_ext(11, ["<f4", bytes(4), 1]), use_bin_type=True))

    listed = _listed_typestrs()
    assert values.NUMPY_SCALAR_TYPESTRS == (listed if x87 else listed - {"<f16", "<c32"})
    for typestr in sorted(values.NUMPY_SCALAR_TYPESTRS):
        dtype = np.dtype(typestr)
        scalar = np.ones(1, dtype=dtype)[0]
        raw = np.ones(1, dtype=dtype).tobytes()
        loaded = state_checkpoint(msgpack.packb([_ext(11, [typestr, raw])], use_bin_type=True))[0]
        assert loaded == scalar and loaded.dtype == dtype.newbyteorder("=") and type(loaded) is type(scalar)
        if typestr[0] != ">":  # what ckptfmt writes: numpy scalars are in the host's (little-endian) order
            url = f"{tmp_path}/scalars/{typestr.strip('<>|')}"
            ckptfmt.save({"s": scalar}, url)
            assert ckptfmt.load(url)["s"] == scalar


def test_long_double_scalars_are_saved_only_where_the_format_means_them(tmp_path, monkeypatch):
    """Where numpy's long double is not x87 extended precision, its `<f16` means another format: refused."""
    monkeypatch.setattr(values, "NUMPY_SCALAR_TYPESTRS", values.NUMPY_SCALAR_TYPESTRS - {"<f16", "<c32"})
    with pytest.raises(UnsupportedValueError, match=r"state\['x'\]: a numpy .* scalar means different things"):
        ckptfmt.save({"x": np.longdouble(1.5)}, f"{tmp_path}/repo/a")


def test_complex_and_opaque_payloads_are_as_the_text_says(state_checkpoint):
    assert "two float 64 (never ints)" in section("7.2")
    for payload in ([1, 2], [1.0, 2], [True, 0.0]):
        with pytest.raises(ManifestError, match="expected float"):
            state_checkpoint(msgpack.packb(_ext(7, payload), use_bin_type=True))
    assert state_checkpoint(msgpack.packb(_ext(7, [1.0, -2.0]), use_bin_type=True)) == 1 - 2j
    opaque = state_checkpoint(msgpack.packb(_ext(12, {"module": "m", "qualname": "Q", "pickle": b"\x80",
                                                      "from_a_future_writer": [1]}), use_bin_type=True))
    assert opaque == values.OpaqueObject("m", "Q", b"\x80")
    assert "other keys MAY follow and are ignored" in section("7.2")


# -- shards: their rank (6.5, 9.3) and how they are packed (5.2) --------------------------

def test_a_shards_rank_is_the_rank_that_held_it_not_a_writer_rank(tmp_path):
    assert "held this shard in the job that produced the state" in table_rows(section("6.5"))["rank"][2]
    assert "as in shard `rank` fields" not in section("9.3") and "is not bound by them" in section("9.3")
    shard_schema = json.loads((SPEC / "manifest.schema.json").read_text())["$defs"]["shard"]["properties"]["rank"]
    assert "held this shard in the job that produced the state" in shard_schema["description"]
    full = torch.arange(12.0)
    sharded = ckptfmt.Sharded((12,), [ckptfmt.Shard((0,), full[:4].clone(), rank=1),
                                      ckptfmt.Shard((4,), full[4:8].clone(), rank=np.int64(5)),
                                      ckptfmt.Shard((8,), full[8:].clone(), rank=2**31 - 1)])
    repo = tmp_path / "repo"
    ckptfmt.save({"w": sharded}, f"{repo}/a")  # one process: world size 1, writer rank 0
    manifest, _ = _manifest_doc(repo, "a")
    entry = manifest["tensors"][0]
    assert "cuts" in entry["shards"]  # three shards that form a grid: written as one (6.11)
    assert [s["rank"] for s in shard_maps(entry["shards"], entry["shape"], 4)] == [1, 5, 2**31 - 1]
    assert (manifest["topology"]["world_size"], manifest["topology"]["writer_ranks"]) == (1, [0])
    validate(json_image(manifest))
    assert torch.equal(ckptfmt.load(f"{repo}/a")["w"], full)
    with ckptfmt.open(f"{repo}/a") as checkpoint:
        assert [s.rank for s in checkpoint.tensor_info("w").shards] == [1, 5, 2**31 - 1]

    for bad in (-1, 2**31, 1.5, True, None, "3"):
        state = {"w": ckptfmt.Sharded((4,), [ckptfmt.Shard((0,), torch.ones(4), rank=bad)])}
        with pytest.raises(UnsupportedValueError, match=r"state\['w'\]: a shard's rank must be an integer"):
            ckptfmt.save(state, f"{repo}/bad")
    assert not (repo / "bad").exists()


def _layout_by_spec(sizes: list[int], chunk_size: int) -> list[list[tuple[int, int, int]]]:
    """Each item's pieces (chunk number, offset, length) as section 5.2 says ckptfmt cuts and packs items."""
    small, pack_limit, align = 256 * 2**10, 4 * 2**20, 64
    count, pack, layout = 0, None, []  # pack: [chunk number, end]
    for size in sizes:
        if size >= small:
            starts = range(0, size, chunk_size)
            layout.append([(count + i, 0, min(chunk_size, size - start)) for i, start in enumerate(starts)])
            count += len(starts)
            continue
        offset = -(-pack[1] // align) * align if pack else 0
        if pack is None or offset + size > pack_limit:
            pack, offset, count = [count, 0], 0, count + 1
        layout.append([(pack[0], offset, size)])
        pack[1] = offset + size
    return layout


def _renumbered(layout: list[list[tuple[int, int, int]]]) -> list[list[tuple[int, int, int]]]:
    """Chunks numbered in order of first use, so that two layouts compare whatever their chunk table order."""
    numbers: dict[int, int] = {}
    return [[(numbers.setdefault(c, len(numbers)), o, n) for c, o, n in pieces] for pieces in layout]


def test_the_shards_of_a_tensor_are_cut_and_packed_one_by_one(tmp_path):
    text = section("5.2")
    assert "each shard of a sharded tensor" in text and "each 64-byte aligned" in text
    gen = torch.Generator().manual_seed(19)
    small = [torch.randn(n, generator=gen) for n in (5, 9, 3)]  # 20, 36 and 12 bytes: one pack, 64-byte aligned
    big = [torch.randn(70_000, generator=gen) for _ in range(2)]  # 280,000 bytes each: chunks of their own
    state = {
        "a": torch.randn(7, generator=gen),
        "small": ckptfmt.Sharded((17,), [ckptfmt.Shard((0,), small[0], 0), ckptfmt.Shard((5,), small[1], 1),
                                         ckptfmt.Shard((14,), small[2], 2)]),
        "big": ckptfmt.Sharded((140_000,), [ckptfmt.Shard((0,), big[0], 0), ckptfmt.Shard((70_000,), big[1], 1)]),
        "b": torch.randn(2, generator=gen),
    }
    chunk_size = 2**17
    ckptfmt.save(state, f"{tmp_path}/repo/a", chunk_size=chunk_size)
    manifest, _ = _manifest_doc(tmp_path / "repo", "a")
    real = [[tuple(p) for p in shard["pieces"]] for entry in manifest["tensors"]
            for shard in shard_maps(entry["shards"], entry["shape"], 4)]
    items = [state["a"], *small, *big, state["b"]]
    assert _renumbered(real) == _renumbered(_layout_by_spec([t.numel() * 4 for t in items], chunk_size))
    assert [offset for (_, offset, _), in real[:4]] == [0, 64, 128, 192]  # a, then each small shard, aligned
    reader = SpecReader(tmp_path / "repo", "a")  # and a reader from the text alone assembles them
    assert reader.tensor_bytes("small")[1] == torch.cat(small).numpy().tobytes()
    assert reader.tensor_bytes("big")[1] == torch.cat(big).numpy().tobytes()


# -- codecs (5.3) and index entries (4.4) -------------------------------------------------

def test_a_writer_chooses_each_chunks_codec(tmp_path):
    assert "**A writer chooses each chunk's codec.**" in section("5.3")
    repo = tmp_path / "repo"
    weights = torch.randn(300, 300, generator=torch.Generator().manual_seed(3))  # float32, 360,000 bytes
    ckptfmt.save({"w": weights}, f"{repo}/plain-zstd", compression="zstd", chunk_size=2**16)
    manifest, _ = _manifest_doc(repo, "plain-zstd")
    assert {c["codec"] for c in manifest["chunks"]} == {"zstd"}  # plain zstd for float32: valid
    reader = SpecReader(repo, "plain-zstd")
    assert reader.tensor_bytes("w")[1] == weights.numpy().tobytes()

    # A checkpoint written by the text's own writer, one chunk recoded: float32 data shuffled with
    # width 8, beside a pack under 'none'.
    handmade = tmp_path / "handmade"
    handmade.mkdir()
    (handmade / "ckptfmt.json").write_text(json.dumps({"format": "ckptfmt-repository", "version": [1, 3]}))
    expected = write_by_spec(handmade, "by-hand")
    manifest_path = next((handmade / "by-hand").glob("manifest-*.msgpack"))
    doc = msgpack.unpackb(manifest_path.read_bytes(), raw=False, strict_map_key=False)
    doc["chunks"][1] = store_chunk(handmade, SpecReader(handmade, "by-hand").chunk(1), "shuffle8-zstd")
    data = msgpack.packb(doc, use_bin_type=True)
    digest = blake3.blake3(data).hexdigest()
    manifest_path.unlink()
    (handmade / "by-hand" / f"manifest-{digest}.msgpack").write_bytes(data)
    commit = json.loads((handmade / "by-hand" / "COMMIT").read_text())
    (handmade / "by-hand" / "COMMIT").write_text(json.dumps({**commit, "manifest": digest, "manifest_size": len(data)}))
    assert torch.equal(ckptfmt.load(f"{handmade}/by-hand")["grid"], torch.from_numpy(expected["grid"]))


def test_index_entries_are_empty_files(worked_example):
    repo, _ = worked_example
    keys = code_blocks(section("4.4"), "")[0]
    assert "an entry: an object of 0 bytes" in keys and "an empty object\n" not in keys
    assert "a file of 0 bytes" in section("4.4")
    entries = list((repo / "_index" / "e").iterdir())
    assert len(entries) == 1 and entries[0].stat().st_size == 0


# -- the reading guide ----------------------------------------------------------------------

def test_every_heading_says_who_needs_it_as_the_reading_guide_lists():
    headings = [(m[2] + (f".{m[3]}" if m[3] else ""), m[4]) for m in _HEADING.finditer(FORMAT)]
    markers = {}
    for number, title in headings:
        found = re.fullmatch(r".*\((readers|writers|optional)\)", title)
        assert found, f"section {number} has no (readers), (writers) or (optional) marker: {title!r}"
        markers[number] = found[1]
    guide = FORMAT[FORMAT.index("**Reading only?**"):FORMAT.index("Every section heading says")]
    listed = set(re.findall(r"§(\d+(?:\.\d+)?)", guide))
    grouping = {number for number, title in headings if re.search(
        rf"^#+ {re.escape(number)}\.? {re.escape(title)}\n\n#", FORMAT, re.M)}  # a heading with no text of its own
    readers = {number for number, marker in markers.items() if marker == "readers"} - grouping
    # A listed section is for readers, and so is each of its subsections; every reader section is listed.
    covered = {n for n in readers if n in listed or n.split(".")[0] in listed}
    assert covered == readers
    assert all(markers[n] == "readers" for n in listed)
    for marker in MARKERS:
        assert f"- **({marker})**" in FORMAT
    # "three fifths of this document" holds, by characters under each marker.
    share = {marker: 0 for marker in MARKERS}
    matches = list(_HEADING.finditer(FORMAT))
    for match, following in zip(matches, matches[1:] + [None]):
        share[markers[match[2] + (f".{match[3]}" if match[3] else "")]] += (
            (following.start() if following else len(FORMAT)) - match.start())
    assert "three fifths of this document" in guide
    assert 0.55 <= share["readers"] / sum(share.values()) <= 0.65


# -- what a second reader of 1.6 found (issue 27) ---------------------------------------------
#
# Each test takes the statement from the text, and checks it against files ckptfmt writes (a run of
# delta saves over every element size, grids, statistics of every dtype) or against what its reader
# accepts.

#: Dtypes that FORMAT.md 8 lists, by name.
DTYPE_NAMES = list(table_rows(section("8")))


def _codecs_of_the_table() -> set[str]:
    """The codec names the first column of section 5.3's table lists."""
    table = section("5.3")[:section("5.3").index("No other codec")]
    return {name for line in table.splitlines() if line.startswith("| `")
            for name in re.findall(r"`([a-z0-9-]+)`", line.split("|")[1])}


@pytest.fixture(scope="module")
def delta_saves(tmp_path_factory):
    """Two runs of 10 saves, one with compression="delta-zstd", one with "auto": chains 1 to 8 deep over
    elements of 1, 2, 4, 8 and 16 bytes, and a pack in each save. -> {compression: (repo, manifests)}"""
    from tests.format.test_spec_schema import delta_run

    runs = {}
    for compression in ("delta-zstd", "auto"):
        repo = tmp_path_factory.mktemp(compression) / "repo"
        delta_run(repo, 10, compression)
        runs[compression] = (repo, [_manifest_doc(repo, f"s{step}")[0] for step in range(10)])
    return runs


def _key_patterns() -> list[tuple[str, re.Pattern]]:
    """The chunk keys of section 4.1's list, as patterns (placeholders become groups), with their line."""
    keys = code_blocks(section("4.1"), "")[0]
    codecs = "|".join(sorted(_codecs_of_the_table(), key=len, reverse=True))
    patterns = []
    for line in keys.splitlines():
        if line.startswith("REPO/chunks/"):
            key = line.split()[0][len("REPO/"):]
            pattern = re.escape(key)
            for placeholder, group in (("<h[0:2]>", "(?P<prefix>[0-9a-f]{2})"), ("<h>", "(?P<h>[0-9a-f]{64})"),
                                       ("<codec>", f"(?P<codec>{codecs})"), ("<b>", "(?P<b>[0-9a-f]{64})")):
                pattern = pattern.replace(re.escape(placeholder), group)
            patterns.append((line, re.compile(pattern)))
    return patterns


def test_every_stored_chunk_has_a_key_that_section_4_1_gives(delta_saves):
    """A reader that follows 4.1 finds every chunk: each row's object matches exactly one key form of the
    list, whose placeholders are the row's hash, codec and (a delta) its base's hash (5.5, 6.3)."""
    patterns = _key_patterns()
    assert patterns
    for repo, manifests in delta_saves.values():
        stored = {path.relative_to(repo).as_posix() for path in (repo / "chunks").rglob("*") if path.is_file()}
        named = set()
        for manifest in manifests:
            chunks = manifest["chunks"]
            for row in chunks:
                found = [(line, m) for line, pattern in patterns for key in stored if (m := pattern.fullmatch(key))
                         and m["h"] == row["hash"] and (m.groupdict().get("codec") or "none") == row["codec"]
                         and m.groupdict().get("b") == (chunks[row["base"]]["hash"] if "base" in row else None)]
                assert len(found) == 1, (row, [line for line, _ in found])
                assert found[0][1]["prefix"] == row["hash"][:2]
                named.add(found[0][1].string)
        assert named == stored  # and every object stored is some row's
        assert any(key.count(".") == 2 for key in named)  # delta chunks were among them


def test_sections_3_and_5_4_name_every_codec_of_the_table():
    """The codec lists of 3 and 5.3 and the decoding step of 5.4 cover every codec, delta codecs included."""
    from ckptfmt.format import codecs

    assert _codecs_of_the_table() == set(codecs.CODECS)
    bullet = section("3")[section("3").index("- **Codec**"):section("3").index("- **Manifest**")]
    listed = [re.compile(name.replace("N", "[0-9]+")) for name in re.findall(r"`([A-Za-z0-9-]+)`", bullet)]
    assert all(any(p.fullmatch(codec) for p in listed) for codec in codecs.CODECS), bullet
    decode = re.search(r"^3\. Decode:(.*?)^4\.", section("5.4"), re.M | re.S)[1]
    for family in ("`none`", "zstd", "shuffle", "delta"):
        assert family in decode, family
    assert "XOR" in decode and "§5.5" in decode


def _referenced_rows(manifest: dict) -> tuple[set[int], set[int]]:
    """The chunk rows that pieces name, and those that a row's ``base`` names."""
    pieces = {piece[0] for entry in manifest["tensors"]
              for shard in shard_maps(entry["shards"], entry["shape"], 1) for piece in shard["pieces"]}
    return pieces, {row["base"] for row in manifest["chunks"] if "base" in row}


def test_every_row_is_named_by_a_piece_or_a_base(delta_saves):
    assert ("Every row SHOULD be referenced by at least one piece or by\nanother row's `base`"
            in section("6.3"))
    only_bases = 0
    for _, manifests in delta_saves.values():
        for manifest in manifests:
            pieces, bases = _referenced_rows(manifest)
            assert pieces | bases == set(range(len(manifest["chunks"])))
            only_bases += len(bases - pieces)
    assert only_bases  # base rows that no piece names: what the text's exception is for


DELTA_WIDTH = {"int8": 1, "bfloat16": 2, "float32": 4, "float64": 8, "complex128": 16}
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def test_delta_saves_use_the_codecs_section_5_5_names(delta_saves):
    """Chunks of a tensor: a delta with N its element size (1 for 16 bytes), or whole with the codec of
    'shuffle-zstd'; packs: never a delta, 'zstd' (or, with "auto", 'none')."""
    from ckptfmt.format.codecs import codec_for

    writers = section("5.5")[section("5.5").index("**Writers.**"):]
    said = re.search(r"`delta-zstd` stores every pack with `([a-z0-9-]+)`", writers)
    assert said, "5.5 does not say which codec a delta save stores packs with"
    pack_codec = said[1]
    assert "a pack included, uncompressed (`none`)" in writers
    assert "for a pack of\none such dtype's tensors, §5.2" in writers
    assert "(1 for elements of 16 bytes)" in writers
    for compression, (_, manifests) in delta_saves.items():
        for manifest in manifests:
            chunks = manifest["chunks"]
            for entry in manifest["tensors"]:
                width = DELTA_WIDTH[entry["dtype"]]
                rows = {piece[0] for shard in shard_maps(entry["shards"], entry["shape"], 1)
                        for piece in shard["pieces"]}
                # 1.11: "auto" stores the chunks of bfloat16, float16, float32 and float64 tensors with the
                # float codecs, whole and as deltas.
                floating = compression == "auto" and entry["dtype"] in FLOAT_DTYPES
                for row in rows:
                    codec = chunks[row]["codec"]
                    if entry["key"] == "small":  # a pack: with "auto", of its float dtype alone (5.2), weighed so
                        if floating:
                            assert codec in {f"float{width}-zstd", f"shuffle{width}-zstd", "none"}, codec
                        else:
                            assert codec in ({pack_codec} if compression == "delta-zstd" else {pack_codec, "none"})
                    elif "base" in chunks[row]:
                        expected = {f"delta{width if width <= 8 else 1}-zstd"} | (
                            {f"floatdelta{width}-zstd"} if floating else set())
                        assert codec in expected, (entry["dtype"], codec)
                    else:
                        assert codec in {codec_for("shuffle-zstd", width)} | (
                            {f"float{width}-zstd"} if floating else set()) | (
                            {"none"} if compression == "auto" else set())
    codecs_used = {row["codec"] for _, manifests in delta_saves.values() for m in manifests for row in m["chunks"]}
    assert {"delta1-zstd", "delta2-zstd", "delta4-zstd", "delta8-zstd", "zstd"} <= codecs_used
    # bf16 elements nudged by 1e-5 mostly do not move: their XOR's zero runs store smaller as delta2-zstd.
    assert {"floatdelta4-zstd", "floatdelta8-zstd"} <= codecs_used
    said = writers[writers.index("from 1.11"):]
    assert all(f"`{dtype}`" in said for dtype in FLOAT_DTYPES), said


# -- shard grids: length and counts (6.11) ----------------------------------------------------

def test_a_grids_length_is_present_exactly_when_its_counts_is(tmp_path):
    row = table_rows(section("6.11"))["length"]
    assert row[0] == "present exactly when `counts` is", row
    assert "`counts` and `length` both present or both absent" in section("6.11")
    schema = json.loads((SPEC / "manifest.schema.json").read_text())["$defs"]["shard_grid"]
    assert schema["dependentRequired"] == {"length": ["counts"], "counts": ["length"]}

    repo = tmp_path / "repo"
    gen = torch.Generator().manual_seed(6)
    whole = torch.randn(4, 70_000, generator=gen)  # 280,000 bytes a row (not packed): three chunks of 2**17
    one_piece = ckptfmt.Sharded((4, 10), [ckptfmt.Shard((r, 0), torch.ones(1, 10), r) for r in range(4)])
    several = ckptfmt.Sharded((4, 70_000), [ckptfmt.Shard((r, 0), whole[r:r + 1].clone(), r) for r in range(4)])
    ckptfmt.save({"one": one_piece, "several": several}, f"{repo}/a", chunk_size=2**17)
    manifest, _ = _manifest_doc(repo, "a")
    grids = {entry["key"]: entry["shards"] for entry in manifest["tensors"]}
    assert not {"counts", "length"} & set(grids["one"]) and {"counts", "length"} <= set(grids["several"])
    assert SpecReader(repo, "a").tensor_bytes("several")[1] == whole.numpy().tobytes()

    storage = Repository.open(str(repo)).storage
    for field in ("counts", "length"):
        ckptfmt.save({"several": several}, f"{repo}/{field}", chunk_size=2**17)
        rewrite_manifest(storage, field, lambda doc, field=field: doc["tensors"][0]["shards"].pop(field))
        broken, _ = _manifest_doc(repo, field)
        assert not VALIDATORS["manifest.schema.json"].is_valid(json_image(broken))
        with pytest.raises(ManifestError, match="length|counts"):
            ckptfmt.open(f"{repo}/{field}")
        with pytest.raises(AssertionError, match="length present exactly when counts is"):
            SpecReader(repo, field).tensor_bytes("several")


# -- statistics (6.10): the sets by dtype, signed zeros, same_as ------------------------------

def _stat_sets() -> dict[str, list[str]]:
    """Section 6.10's field sets, by name."""
    text = section("6.10")
    assert "| set | fields |" in text, "6.10 names no field sets"
    table = text[text.index("| set | fields |"):text.index("Which set a tensor carries")]
    return {name: re.findall(r"`(\w+)`", cells[0]) for name, cells in
            ((line.split("|")[1].strip(), line.split("|")[2:]) for line in table.splitlines()[2:] if line.strip())}


def _sets_by_dtype() -> dict[str, list[str]]:
    """Section 6.10's table of the sets a reader accepts, by dtype name, in the order the row lists them."""
    text = section("6.10")
    assert "| dtypes | sets a reader accepts |" in text, "6.10 does not say which sets each dtype may carry"
    table = text[text.index("| dtypes | sets a reader accepts |"):text.index("| field | type | meaning |")]
    accepted = {}
    for line in table.splitlines()[2:]:
        if line.strip():
            dtypes, sets = line.split("|")[1:3]
            for name in re.findall(r"`(\w+)`", dtypes):
                assert name not in accepted, f"{name} in two rows"
                accepted[name] = [s.strip() for s in sets.split(",")]
    return accepted


def _stats_of_set(fields: list[str], count: int) -> dict:
    zero = {"count": count, "min": 0.0, "max": 0.0, "mean": 0.0, "l2": 0.0, "absmax": 0.0, "nan": 0, "posinf": 0,
            "neginf": 0, "zeros": count}
    return {field: zero[field] for field in fields}


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory):
    """A checkpoint with a tensor of 8 zero bytes of every dtype this torch has, keyed by the dtype's name."""
    from ckptfmt.tensors.dtypes import DTYPES

    repo = tmp_path_factory.mktemp("dtypes") / "repo"
    state = {name: torch.zeros(16, dtype=torch.uint8).view(dtype) for name, dtype in DTYPES.items()}
    ckptfmt.save(state, f"{repo}/all")
    return repo, state


def test_the_statistics_sets_by_dtype_are_the_table_of_section_6_10(every_dtype):
    from ckptfmt.format.tensor_stats import COUNT_FIELDS, FLOAT_FIELDS, INTEGER_FIELDS
    from ckptfmt.tensors.stats import fields_for

    sets, accepted = _stat_sets(), _sets_by_dtype()
    assert sets == {"float": list(FLOAT_FIELDS), "integer": list(INTEGER_FIELDS), "count": list(COUNT_FIELDS)}
    assert sorted(accepted) == sorted(DTYPE_NAMES)  # every dtype of section 8, each in one row
    assert all(row[-1] == "count" and set(row) <= set(sets) for row in accepted.values())  # the count alone: always

    # What ckptfmt writes is the first set of the dtype's row, or the count alone where its torch cannot
    # reduce the dtype, as the text names those.
    repo, state = every_dtype
    text = section("6.10")
    count_only = set(re.findall(r"`(\w+)`", text[text.index("which with torch"):text.index("So a reader")]))
    manifest, _ = _manifest_doc(repo, "all")
    for entry in manifest["tensors"]:
        written = next(name for name, fields in sets.items() if list(entry["stats"]) == fields)
        assert written in accepted[entry["dtype"]], entry
        reduced = fields_for(state[entry["dtype"]].dtype) is not COUNT_FIELDS
        assert written == (accepted[entry["dtype"]][0] if reduced else "count"), entry
        if written != accepted[entry["dtype"]][0]:
            assert entry["dtype"] in count_only, entry["dtype"]

    # Every set a row lists is read, whichever writer wrote it; the schema agrees.
    storage = Repository.open(str(repo)).storage
    for choice in range(2):
        name = f"all-{choice}"
        ckptfmt.save(state, f"{repo}/{name}")

        def give(doc, choice=choice):
            for entry in doc["tensors"]:
                row = accepted[entry["dtype"]]
                entry["stats"] = _stats_of_set(sets[row[min(choice, len(row) - 1)]], 16 // DTYPE_SIZES[entry["dtype"]])
        rewrite_manifest(storage, name, give)
        validate(json_image(_manifest_doc(repo, name)[0]))
        with ckptfmt.open(f"{repo}/{name}") as checkpoint:
            assert checkpoint.tensor_stats("float32") == _stats_of_set(sets[accepted["float32"][choice]], 4)


def _misfits() -> list[tuple[str, str]]:
    """(dtype, set) pairs section 6.10 does not allow."""
    accepted, sets = _sets_by_dtype(), _stat_sets()
    return [(dtype, name) for dtype in DTYPE_NAMES for name in sets if name not in accepted[dtype]]


def test_the_schema_refuses_statistics_sets_a_dtype_does_not_list(every_dtype):
    repo, _ = every_dtype
    manifest, _ = _manifest_doc(repo, "all")
    image = json_image(manifest)
    sets, misfits = _stat_sets(), _misfits()
    assert ("float32", "integer") in misfits and ("int64", "float") in misfits and ("complex64", "integer") in misfits
    written = {entry["dtype"] for entry in image["tensors"]}
    for dtype, name in (pair for pair in misfits if pair[0] in written):
        entry = {**next(e for e in image["tensors"] if e["dtype"] == dtype)}
        entry["stats"] = _stats_of_set(sets[name], entry["stats"]["count"])
        assert not VALIDATORS["manifest.schema.json"].is_valid({**image, "tensors": [entry]}), (dtype, name)


def test_the_reader_refuses_statistics_sets_a_dtype_does_not_list(every_dtype):
    repo, state = every_dtype
    storage = Repository.open(str(repo)).storage
    sets, refused = _stat_sets(), []
    misfits = [(dtype, name) for dtype, name in _misfits() if dtype in state]
    for dtype, name in misfits:
        checkpoint = f"misfit-{dtype}-{name}".replace("_", "-")
        ckptfmt.save({dtype: state[dtype]}, f"{repo}/{checkpoint}")
        rewrite_manifest(storage, checkpoint, lambda doc, name=name: doc["tensors"][0].update(
            stats=_stats_of_set(sets[name], doc["tensors"][0]["stats"]["count"])))
        try:
            ckptfmt.open(f"{repo}/{checkpoint}").close()
        except ManifestError as exc:
            assert "stats" in str(exc)
            refused.append((dtype, name))
    assert refused == misfits


DTYPE_SIZES = {name: int(cells[0]) for name, cells in table_rows(section("8")).items()}


def _extremes_by_the_text(values: list[float]) -> tuple[float, float]:
    """min and max as the row of 6.10 says: the finite extremes, -0.0 below +0.0."""
    finite = [v for v in values if math.isfinite(v)]
    low, high = min(finite), max(finite)
    signs = [math.copysign(1.0, v) for v in finite if v == 0]
    if low == 0:
        low = -0.0 if -1.0 in signs else 0.0
    if high == 0:
        high = 0.0 if 1.0 in signs else -0.0
    return low, high


def _same(a: float, b: float) -> bool:
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def test_a_zero_extreme_has_one_sign_whatever_the_order_and_the_cut(tmp_path):
    """Writers agree exactly on min and max (6.10): the sign of a zero extreme comes from the elements,
    not from their order, the chunks or the shards."""
    row = table_rows(section("6.10"))["min`, `max"]
    assert "-0.0 is below +0.0" in row[1]
    assert "the sign of a zero `min` or `max` included" in section("6.10")
    repo = tmp_path / "repo"
    cases = [[0.0, -0.0], [-0.0, 0.0], [-0.0, -0.0], [0.0, 0.0], [0.0, 3.0, -0.0], [-3.0, -0.0, 0.0],
             [-0.0, -3.0], [float("nan"), 0.0, -0.0]]
    state = {f"{dtype}-{i}": torch.tensor(values, dtype=torch.float64).to(getattr(torch, dtype))
             for dtype in ("float32", "float64", "bfloat16", "float8_e5m2") for i, values in enumerate(cases)}
    big = 70_000  # 280,000 bytes of float32: cut into chunks of 2**16 bytes, the zeros far apart
    for i, (first, second) in enumerate(((0.0, -0.0), (-0.0, 0.0))):
        tensor = torch.full((big,), first)
        tensor[-1] = second
        state[f"chunked-{i}"] = tensor
        shards = [ckptfmt.Shard((0,), torch.full((4,), first), 0), ckptfmt.Shard((4,), torch.full((4,), second), 1)]
        state[f"sharded-{i}"] = ckptfmt.Sharded((8,), shards)
    ckptfmt.save(state, f"{repo}/a", chunk_size=2**16)
    manifest, _ = _manifest_doc(repo, "a")
    loaded = ckptfmt.load(f"{repo}/a")
    for entry in manifest["tensors"]:
        low, high = _extremes_by_the_text(loaded[entry["key"]].to(torch.float64).tolist())
        stats = entry["stats"]
        assert _same(stats["min"], low) and _same(stats["max"], high), (entry["key"], stats)


def test_a_same_as_entrys_statistics_are_checked_and_not_used(tmp_path):
    text = section("6.10")
    assert "writers SHOULD NOT give it `stats`" in text and "carries none" not in text
    assert "MUST NOT use them" in text
    repo = tmp_path / "repo"
    tied = torch.tensor([1.0, -2.0, 3.0])
    ckptfmt.save({"a": tied, "b": tied}, f"{repo}/tied")
    manifest, _ = _manifest_doc(repo, "tied")
    assert manifest["tensors"][1]["same_as"] == 0 and "stats" not in manifest["tensors"][1]  # ckptfmt gives none
    storage = Repository.open(str(repo)).storage
    for name, count in (("other", 3), ("wrong-count", 4)):
        ckptfmt.save({"a": tied, "b": tied}, f"{repo}/{name}")
        rewrite_manifest(storage, name, lambda doc, count=count: doc["tensors"][1].update(
            stats=_stats_of_set(_stat_sets()["float"], count)))
        if count == 3:  # accepted, and the named entry's statistics are the tensor's
            with ckptfmt.open(f"{repo}/{name}") as checkpoint:
                assert checkpoint.tensor_stats("b") == checkpoint.tensor_stats("a") == manifest["tensors"][0]["stats"]
        else:
            with pytest.raises(ManifestError, match="stats count"):
                ckptfmt.open(f"{repo}/{name}")


# -- limits (14) --------------------------------------------------------------------------------

def _limit_rows() -> dict[str, str]:
    """Section 14's table of limits: the first cell -> the second."""
    text = section("14")
    table = text[text.index("| limit | value |"):text.index("Consistency checks")]
    return {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table.splitlines()[2:] if line.strip()}


def _metadata_fields() -> tuple[set[str], set[str]]:
    """The optional top-level fields of the manifest schema that hold maps or arrays (run metadata),
    and of those the ones that are maps."""
    schema = json.loads((SPEC / "manifest.schema.json").read_text())

    def types(node) -> set[str]:
        if "$ref" in node:
            return types(schema["$defs"][node["$ref"].split("/")[-1]])
        found = set(node["type"]) if isinstance(node.get("type"), list) else {node["type"]} if "type" in node else set()
        for choice in node.get("oneOf", []):
            found |= types(choice)
        return found
    optional = {name: types(node) for name, node in schema["properties"].items()
                if name not in schema["required"] and name != "requires"}  # §13.2: a flat array of names
    containers = {name for name, kinds in optional.items() if kinds & {"object", "array"}}
    return containers, {name for name in containers if "object" in optional[name]}


def test_section_14_bounds_and_checks_every_top_level_map(tmp_path):
    containers, maps = _metadata_fields()
    assert {"environment", "provenance", "replicas"} <= maps and "rng" in containers - maps
    nesting = next(value for limit, value in _limit_rows().items() if limit.startswith("nesting of maps"))
    nested = next(limit for limit in _limit_rows() if limit.startswith("nesting of maps"))
    assert containers <= set(re.findall(r"`(\w+)`", nested)), nested
    bullet = next(item for item in section("14").split("\n- ") if "are maps or nil" in item)
    assert maps <= set(re.findall(r"`(\w+)`", bullet[:bullet.index("are maps or nil")])), bullet

    # ckptfmt checks each as the text says: nested 65 deep, or not a map, refused; nil accepted.
    depth = int(nesting)
    repo = tmp_path / "repo"
    storage = Repository.open(str(repo), create=True).storage
    deep: object = 1
    for _ in range(depth + 1):
        deep = [deep]
    for field in sorted(containers):
        nested, other = ({"x": deep}, [1]) if field in maps else ([{"x": deep}], {"x": 1})
        for name, value, refused in ((f"{field}-deep".replace("_", "-"), nested, "nested deeper"),
                                     (f"{field}-nil", None, None), (f"{field}-other", other, "has type")):
            ckptfmt.save({"w": torch.ones(2)}, f"{repo}/{name}")
            rewrite_manifest(storage, name, lambda doc, field=field, value=value: doc.update({field: value}))
            if refused is None:
                ckptfmt.open(f"{repo}/{name}").close()
            else:
                with pytest.raises(ManifestError, match=refused):
                    ckptfmt.open(f"{repo}/{name}")


def test_a_piece_offset_has_one_bound_in_both_forms_of_shards(tmp_path):
    from ckptfmt.format.limits import MAX_CHUNK_BYTES

    rows = _limit_rows()
    piece_rows = {limit: value for limit, value in rows.items() if "piece" in limit}
    assert piece_rows.get("piece `offset`", "").startswith("int in [0, 4 GiB]"), piece_rows
    assert not any("offset" in limit for limit in piece_rows if limit != "piece `offset`")
    assert "every `offset` and\n`length` at most 4 GiB" in section("6.11")
    repo = tmp_path / "repo"
    storage = Repository.open(str(repo), create=True).storage
    sharded = ckptfmt.Sharded((4,), [ckptfmt.Shard((0,), torch.ones(2), 0), ckptfmt.Shard((2,), torch.ones(2), 1)])
    for name, state in (("maps", {"w": torch.ones(2)}), ("grid", {"w": sharded})):
        ckptfmt.save(state, f"{repo}/{name}")

        def far(doc, name=name):
            shards = doc["tensors"][0]["shards"]
            if name == "maps":
                shards[0]["pieces"][0][1] = MAX_CHUNK_BYTES + 1
            else:
                shards["offset"] = np.array([MAX_CHUNK_BYTES + 1] * 2, dtype="<u8").tobytes()
        rewrite_manifest(storage, name, far)
        if name == "maps":  # a grid's columns are bins: their bounds are the prose's alone
            assert not VALIDATORS["manifest.schema.json"].is_valid(json_image(_manifest_doc(repo, name)[0]))
        with pytest.raises(ManifestError, match="runs past chunk|outside"):
            ckptfmt.open(f"{repo}/{name}")


# -- the text against itself: versions and cross-references ----------------------------------

def _spec_texts(changelog: bool = True) -> dict[str, str]:
    """FORMAT.md, ANALYTICS.md, every schema's text, and CHANGES.md (which names versions as historical
    facts) if ``changelog``."""
    texts = {"FORMAT.md": FORMAT, "ANALYTICS.md": (SPEC / "ANALYTICS.md").read_text()}
    if changelog:
        texts["CHANGES.md"] = CHANGES
    texts.update({path.name: path.read_text() for path in SPEC.glob("*.schema.json")})
    return texts


#: "1.0 to 1.5", "up to 1.6", "up to version 1.6": format versions, not figures ("1.3x to 1.6x", "1.5 GiB").
_RANGE = re.compile(r"\b([12])\.(\d+)\s+(?:to|up\s+to|through)\s+([12])\.(\d+)"
                    r"|\bup\s+to\s+(?:version\s+)?([12])\.(\d+)")
_NOT_A_VERSION = re.compile(r"\.\d|x\b|\s*(?:s\b|[KMGT]i?B\b|%)")


def test_no_version_range_ends_before_this_version():
    """A range of versions outside the changelog speaks of this document's version: '1.0 to 1.5' in a
    1.6 document is stale (it was true when 1.5 was current)."""
    found = 0
    for name, text in _spec_texts(changelog=False).items():
        for match in _RANGE.finditer(text):
            if _NOT_A_VERSION.match(text, match.end()):
                continue
            groups = [int(g) for g in match.groups() if g is not None]
            end = tuple(groups[-2:])
            found += 1
            assert end == FORMAT_VERSION, f"{name}: {match[0]!r} ends before {FORMAT_VERSION}"
    assert found >= 3


#: "§6.5", "§4.4, 1.3", "§11.1 step 4", "§11.1 steps 3 and 4"; not another document's ("RFC 4648 §4").
_SECTION_REF = re.compile(r"(?<!RFC \d{4} )§(\d+(?:\.\d+)?)(?:,? (1\.\d+)\b)?(?:\s+steps?\s+(\d+)(?:\s+and\s+(\d+))?)?")
#: "steps 2 and 3 of §5.4"
_STEPS_OF = re.compile(r"\bsteps?\s+(\d+)(?:\s+and\s+(\d+))?\s+of\s+§(\d+(?:\.\d+)?)")


def test_cross_references_name_sections_steps_versions_and_files_that_exist():
    headings = {".".join(filter(None, m.group(2, 3))): m[4] for m in _HEADING.finditer(FORMAT)}
    for name, text in _spec_texts().items():
        if name.endswith(".md"):
            refs = _SECTION_REF.findall(text) + [(number, "", *steps) for *steps, number in _STEPS_OF.findall(text)]
        else:  # a schema's description: "FORMAT.md 6.10"
            refs = [(ref, "", "", "") for ref in re.findall(r"FORMAT\.md §?(\d+(?:\.\d+)?)", text)]
        assert refs or name in ("commit.schema.json", "repository.schema.json"), name
        for number, version, *steps in refs:
            assert number in headings, f"{name}: §{number} is no section"
            added = re.search(r"\((1\.\d+)\)", headings[number])
            if version and added:
                assert version == added[1], f"{name}: §{number} is {added[1]}'s, cited as {version}'s"
            for step in filter(None, steps):
                assert re.search(rf"^{step}\. ", section(number), re.M), f"{name}: §{number} has no step {step}"
    root = SPEC.parent
    for path in set(re.findall(r"`((?:tests|spec|ckptfmt)/[\w/.-]+|[\w-]+\.schema\.json)`", FORMAT)):
        assert (root / path).exists() or (SPEC / path).exists(), f"FORMAT.md names {path}, which does not exist"
