"""``ckptfmt sync --format-version V`` and ``replicate(format_version=)``: a repository rewritten for readers
of an older format version (spec 13.3).

What must hold: every manifest, commit record and the marker of the destination is of version V, in V's
forms (tables as rows, shard grids, generator states as ints) and with V's codecs only; the checkpoints
load bit for bit as the source's and verify; chunks whose codec V has are the source's objects, shared,
not written again; the source's signatures, which do not sign the new manifests, are dropped and said to
be, or ``--sign`` signs the new ones; what V cannot express is refused in one line before anything of
that checkpoint is written; a repository V's readers read already is copied byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings

import msgpack
import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointExistsError
from ckptfmt.errors import CheckpointWarning, UnsupportedVersionError
from ckptfmt.format import layout
from ckptfmt.format.codecs import is_delta, is_float
from ckptfmt.format.version import FORMAT_VERSION
from ckptfmt.lifecycle.replicate import replicate
from ckptfmt.lifecycle.signing import generate_key
from ckptfmt.repository.repository import Repository
from ckptfmt.storage.factory import open_storage
from tests.corpus.generate import VERSIONS
from tests.support.helpers import ANY_SIZE, assert_same, needs_tool, sync_cli
from tests.support.old_trees import ROOT, run_in_tree

NAMES = ["a", "b", "c"]


def states() -> list[dict]:
    """Three states: weights that move a little (so that deltas pay), bf16, ints, a sharded tensor."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 1024, generator=g)
    sharded = ckptfmt.Sharded((8, 2048), tuple(ckptfmt.Shard((2 * r, 0), torch.randn(2, 2048, generator=g), rank=r)
                                               for r in range(4)))
    a = {"w": w, "h": torch.randn(40_000, generator=g).to(torch.bfloat16), "i": torch.arange(20_000),
         "sh": sharded, "step": 1}
    b = {**a, "w": w + 1e-3, "h": a["h"] + 0.01, "step": 2}
    c = {**b, "w": w + 2e-3, "step": 3}
    return [a, b, c]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A repository saved at this ckptfmt's own version: float codecs, float deltas and deltas on them,
    sharded tensors, every checkpoint signed. Returns its URL and the private key's path."""
    root = tmp_path_factory.mktemp("sync-format-version")
    src = str(root / "src")
    a, b, c = states()
    ckptfmt.save(a, f"{src}/a", step=1, chunk_size=64 * 1024, compression="float-zstd")
    ckptfmt.save(b, f"{src}/b", step=2, chunk_size=64 * 1024, compression="auto")
    ckptfmt.save(c, f"{src}/c", step=3, chunk_size=64 * 1024, compression="delta-zstd")
    key, _, _ = generate_key(root / "key")
    ckptfmt.sign(src, key)
    codecs = {chunk.codec for name in NAMES for chunk in Repository.open(src).manifest(name).chunks}
    assert {"float4-zstd", "floatdelta4-zstd", "delta4-zstd"} <= codecs  # what the rewrite must handle
    return src, key


def manifest_doc(url: str, name: str) -> dict:
    """Checkpoint ``name``'s manifest as stored, decoded."""
    storage = open_storage(url)
    record = Repository(storage).commit(name)
    data = storage.read(layout.manifest_key(name, record.manifest_hash), max_size=ANY_SIZE)
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def stored(url: str, key: str) -> bytes:
    return open_storage(url).read(key, max_size=ANY_SIZE)


def chunk_files(url: str) -> set[str]:
    found = open_storage(url).find(layout.CHUNKS_DIR)
    return {key for key in found if not key.rsplit("/", 1)[-1].startswith(".")}


def used_keys(url: str) -> set[str]:
    """The chunk keys the committed checkpoints of ``url`` name."""
    from ckptfmt.format.chunk_table import stored_key

    repo = Repository.open(url)
    return {stored_key(chunks, c) for name in repo.names() for chunks in [repo.manifest(name).chunks] for c in chunks}


def assert_written_for(url: str, version: tuple[int, int]) -> None:
    """Everything of repository ``url`` is of ``version`` and in its forms and codecs."""
    marker = json.loads(stored(url, layout.MARKER_KEY))
    assert marker["version"] == list(version) and "requires" not in marker
    for name in NAMES:
        doc = manifest_doc(url, name)
        assert doc["version"] == list(version) and "requires" not in doc
        commit = json.loads(stored(url, layout.commit_key(name)))
        assert commit["version"] == list(version)
        chunks, tensors = doc["chunks"], doc["tensors"]
        assert isinstance(chunks, dict) == (version >= (1, 13))
        assert isinstance(tensors, dict) == (version >= (1, 12))
        codecs = set(chunks["codecs"]) if isinstance(chunks, dict) else {row["codec"] for row in chunks}
        assert not any(map(is_float, codecs)) or version >= (1, 11), codecs
        assert not any(map(is_delta, codecs)) or version >= (1, 5), codecs
        if isinstance(tensors, list):
            grids = [row["key"] for row in tensors if isinstance(row["shards"], dict)]
            assert not grids or version >= (1, 6)
        python_state = doc["rng"][0]["python"]["state"]
        assert isinstance(python_state, bytes) == (version >= (1, 13))


def assert_same_checkpoints(src: str, dst: str) -> None:
    for name in NAMES:
        assert_same(ckptfmt.load(f"{src}/{name}"), ckptfmt.load(f"{dst}/{name}"), name)
    report = ckptfmt.verify(dst)
    assert report.ok and sorted(report.checkpoints) == NAMES


#: Run under the ckptfmt that introduced a version: loads every checkpoint of a repository, prints each tensor's
#: sha256 and what verify says.
OLD_READER = """
import hashlib, json, sys
import torch, ckptfmt
url = sys.argv[1]
tensors = {}
for name in sys.argv[2:]:
    for key, value in ckptfmt.load(f"{url}/{name}").items():
        if isinstance(value, torch.Tensor):
            data = value.contiguous().view(torch.uint8).numpy().tobytes()
            tensors[f"{name}/{key}"] = hashlib.sha256(data).hexdigest()
report = ckptfmt.verify(url)
print(json.dumps({"tensors": tensors, "ok": report.ok, "problems": [str(p) for p in report.problems]}))
"""
SHALLOW = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)


def tensor_hashes(url: str) -> dict[str, str]:
    hashes = {}
    for name in NAMES:
        for key, value in ckptfmt.load(f"{url}/{name}").items():
            if isinstance(value, torch.Tensor):
                data = value.contiguous().view(torch.uint8).numpy().tobytes()
                hashes[f"{name}/{key}"] = hashlib.sha256(data).hexdigest()
    return hashes


@pytest.mark.slow
@needs_tool(SHALLOW.stdout.strip() == "false", "needs the repository's history (not a shallow clone)")
@pytest.mark.parametrize("version", ["1.0", "1.4", "1.6", "1.11"])
def test_the_ckptfmt_of_that_version_reads_the_rewrite(version, source, tmp_path):
    """The real reader of the version (the commit that introduced it) loads every tensor bit for bit and
    verifies the destination."""
    src, _ = source
    dst = str(tmp_path / "dst")
    replicate(src, dst, format_version=version)
    found = run_in_tree(VERSIONS[version], OLD_READER, dst, *NAMES, timeout=300)
    assert found["ok"] and not found["problems"]
    assert found["tensors"] == tensor_hashes(src)


@pytest.mark.parametrize("version", ["1.4", "1.6", "1.11"])
def test_cli_rewrites_for_an_older_reader(version, source, tmp_path):
    src, _ = source
    dst = str(tmp_path / "dst")
    code, out, err = sync_cli(src, dst, "--format-version", version)
    assert code == 0, err
    floor = tuple(map(int, version.split(".")))
    assert_written_for(dst, floor)
    assert_same_checkpoints(src, dst)
    assert "rewrote 3 checkpoints for format " + version in out
    assert "dropped 3 signatures" in out  # the source's sign manifests the destination does not hold
    for name in NAMES:
        assert not [e for e in open_storage(dst).list(name) if e.startswith("signature")]
    # Nothing written twice or for nothing: every chunk object is one the checkpoints name; those whose
    # codec the version has are the source's objects, byte for byte (shared, not re-encoded).
    assert chunk_files(dst) == used_keys(dst)
    shared = used_keys(dst) & used_keys(src)
    reencoded = used_keys(dst) - used_keys(src)
    assert shared and all(stored(dst, key) == stored(src, key) for key in shared)
    assert bool(reencoded) == (floor < (1, 11))


def test_json_report_and_a_second_run(source, tmp_path):
    src, _ = source
    dst = str(tmp_path / "dst")
    code, out, _ = sync_cli(src, dst, "--format-version", "1.6", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["format_version"] == "1.6" and data["rewritten"] == NAMES and data["copied"] == NAMES
    assert data["signatures_dropped"] == 3 and data["chunks_reencoded"] > 0 and data["signatures_copied"] == 0
    before = {key: stored(dst, key) for key in chunk_files(dst)}

    code, out, _ = sync_cli(src, dst, "--format-version", "1.6", "--json")  # the rewritten copies count
    data = json.loads(out)
    assert code == 0 and data["copied"] == [] and data["present"] == NAMES and data["bytes_copied"] == 0
    assert {key: stored(dst, key) for key in chunk_files(dst)} == before


def test_library_rewrites_and_signs_with_the_key(source, tmp_path):
    src, key = source
    dst = str(tmp_path / "dst")
    report = replicate(src, dst, format_version=(1, 11), signer=key)
    assert report.rewritten == tuple(NAMES) and report.signatures_written == 3 and report.signatures_dropped == 3
    assert report.chunks_reencoded == 0  # 1.11 has every codec: only the forms change
    assert_written_for(dst, (1, 11))
    assert_same_checkpoints(src, dst)
    assert ckptfmt.verify(dst, trusted_keys=[f"{key}.pub"]).ok
    # Signing again signs nothing new.
    again = replicate(src, dst, format_version="1.11", signer=key)
    assert again.copied == () and again.present == tuple(NAMES) and again.signatures_written == 0


def test_memory_destination(source, memory_root):
    src, _ = source
    dst = f"{memory_root}/dst"
    report = replicate(src, dst, format_version="1.4")
    assert report.rewritten == tuple(NAMES)
    assert_written_for(dst, (1, 4))
    assert_same_checkpoints(src, dst)


def test_a_repository_already_readable_is_copied_byte_for_byte(source, tmp_path):
    src, _ = source
    old, again = str(tmp_path / "old"), str(tmp_path / "again")
    replicate(src, old, format_version="1.6")
    report = replicate(old, again, format_version="1.11")  # 1.6 checkpoints are read by 1.11's readers
    assert report.rewritten == () and report.copied == tuple(NAMES) and report.chunks_reencoded == 0
    assert chunk_files(again) == chunk_files(old)
    for name in NAMES:
        record = Repository.open(old).commit(name)
        for key in (layout.commit_key(name), layout.manifest_key(name, record.manifest_hash)):
            assert stored(again, key) == stored(old, key)
    assert json.loads(stored(again, layout.MARKER_KEY))["version"] == [1, 11]  # created for the version asked


def test_saved_at_the_floor_is_copied_as_it_is(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    ckptfmt.save({"w": torch.arange(1000.0)}, f"{src}/a", format_version="1.6", compression="shuffle-zstd")
    code, out, _ = sync_cli(src, dst, "--format-version", "1.6")
    assert code == 0 and "rewrote 0 checkpoints" in out
    record = Repository.open(src).commit("a")
    assert stored(dst, layout.manifest_key("a", record.manifest_hash)) == stored(
        src, layout.manifest_key("a", record.manifest_hash))


def test_what_the_version_cannot_express_is_refused(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    ckptfmt.save({"w": torch.arange(10.0)}, f"{src}/a")
    ckptfmt.save({"w": torch.arange(10.0), "loader": ckptfmt.PerRank({"position": 3})}, f"{src}/b")
    code, out, err = sync_cli(src, dst, "--format-version", "1.0")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "b" in err and "per-rank-values" in err and "1.1" in err and "1.0 cannot express it" in err
    assert not open_storage(dst).exists(layout.MARKER_KEY)  # refused before anything was written
    code, _, err = sync_cli(src, dst, "--format-version", "1.0", "--name", "a")
    assert code == 0 and Repository.open(dst).names() == ["a"]  # what the version expresses goes
    with pytest.raises(UnsupportedVersionError, match="per-rank-values"):
        replicate(src, str(tmp_path / "other"), format_version="1.0")
    # From 1.1 it is expressible.
    assert replicate(src, str(tmp_path / "third"), format_version="1.1").rewritten == ("a", "b")


def test_bad_options_are_one_line_errors(source, tmp_path):
    src, key = source
    dst = str(tmp_path / "dst")
    code, _, err = sync_cli(src, dst, "--format-version", "1.6", "--sign", key)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--sign needs format 1.7" in err
    code, _, err = sync_cli(src, dst, "--sign", key)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--format-version" in err
    with pytest.raises(SystemExit):
        sync_cli(src, dst, "--format-version", "1.99")
    with pytest.raises(ValueError, match="cannot write format 3.0"):
        replicate(src, dst, format_version="3.0")
    assert not open_storage(dst).exists(layout.MARKER_KEY)  # refused before anything was written


def test_newer_destination_marker_warns_and_rises_not(source, tmp_path):
    src, _ = source
    dst = str(tmp_path / "dst")
    ckptfmt.save({"x": torch.zeros(3)}, f"{dst}/other")  # a repository of this ckptfmt's format
    with pytest.warns(CheckpointWarning, match="newer than 1.6"):
        report = replicate(src, dst, format_version="1.6")
    assert report.rewritten == tuple(NAMES)
    assert json.loads(stored(dst, layout.MARKER_KEY))["version"] == list(FORMAT_VERSION)
    for name in NAMES:
        assert manifest_doc(dst, name)["version"] == [1, 6]
    assert ckptfmt.verify(dst).ok


def test_a_newer_copy_at_the_destination_is_an_error(source, tmp_path):
    src, _ = source
    dst = str(tmp_path / "dst")
    replicate(src, dst, name="a")  # byte for byte: format 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(CheckpointExistsError, match="newer than 1.6"):
            replicate(src, dst, format_version="1.6")


def test_run_histories_are_written_for_the_version(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    ckptfmt.save({"w": torch.arange(100.0)}, f"{src}/a", step=1)
    ckptfmt.save({"w": torch.arange(100.0) + 1}, f"{src}/b", step=2)
    Repository.open(src).remove("a")  # keeps a's run history (spec 4.5), an object of format 2.0
    report = replicate(src, dst, format_version="1.11")
    assert report.copied == ("b",) and report.histories_copied == 1
    (entry,) = open_storage(dst).list("_history")
    doc = msgpack.unpackb(stored(dst, f"_history/{entry}"), raw=False)
    assert doc["version"] == [1, 11] and doc["name"] == "a" and "requires" not in doc
    assert ckptfmt.verify(dst).ok
    assert replicate(src, dst, format_version="1.11").histories_copied == 0  # the rewritten one counts


def test_s3_destination(source, s3_bucket):
    src, _ = source
    dst = f"{s3_bucket}/dst"
    report = replicate(src, dst, format_version="1.6")
    assert report.rewritten == tuple(NAMES) and report.chunks_reencoded > 0
    assert_written_for(dst, (1, 6))
    assert_same_checkpoints(src, dst)


def test_help_fits_80_columns():
    result = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "sync", "--help"], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "80"}, check=True)
    assert "--format-version V" in result.stdout and "--sign KEY" in result.stdout
    assert max(map(len, result.stdout.splitlines())) <= 80


def test_chunks_stored_again_earlier_are_checked_and_shared(source, tmp_path):
    """A later sync finds the chunks an earlier one stored again (the float bases of 'a' that the deltas
    of 'b' and 'c' name): intact ones are used as they are, a damaged one is written again."""
    src, _ = source
    dst = str(tmp_path / "dst")
    first = replicate(src, dst, name="a", format_version="1.4")
    assert first.chunks_reencoded > 0
    reencoded = sorted(used_keys(dst) - used_keys(src))
    with open(f"{dst}/{reencoded[0]}", "r+b") as file:  # a flipped byte: it no longer decodes to its hash
        file.seek(-1, 2)
        last = file.read(1)
        file.seek(-1, 2)
        file.write(bytes([last[0] ^ 1]))
    Repository.open(dst).remove("a")
    report = replicate(src, dst, format_version="1.4")
    assert report.copied == tuple(NAMES) and report.chunks_skipped > 0
    # Stored again now: the damaged one and those of 'b' and 'c' alone, not the others of the first run.
    assert report.chunks_reencoded == len(used_keys(dst) - used_keys(src)) - len(reencoded) + 1
    assert chunk_files(dst) == used_keys(dst)
    assert_same_checkpoints(src, dst)


def test_an_ml_dsa_key_is_refused_below_2_0(source, tmp_path):
    src, _ = source
    key, _, _ = generate_key(tmp_path / "pq", algorithm="ml-dsa-65")
    dst = str(tmp_path / "dst")
    with pytest.raises(ValueError, match="needs format 2.0"):
        replicate(src, dst, format_version="1.11", signer=key)
    code, _, err = sync_cli(src, dst, "--format-version", "1.11", "--sign", key)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "ml-dsa-65" in err
    assert not open_storage(dst).exists(layout.MARKER_KEY)


def test_the_progress_counts_the_chunks_stored_again_too(source, tmp_path):
    """A sync for an older reader counts every chunk it copies and every one it stores again: the bar ends
    full (it stopped short by the re-encoded rows' bytes)."""
    from fsspec.callbacks import Callback

    src, _ = source
    seen, plain = Callback(), Callback()
    replicate(src, str(tmp_path / "dst"), format_version="1.4", callback=seen)
    replicate(src, str(tmp_path / "copy"), callback=plain)  # byte for byte: every chunk copied
    assert seen.size == plain.size and seen.value == seen.size  # the same source bytes, whatever becomes of them
