"""Every CLI command on every hostile repository: a clear outcome, never a traceback or a Python exception name.

A command either works (stray entries are ignored), reports damage (verify
exits 1 with its table), or fails with exit 2 and exactly one line on stderr
that says what and where; which of the three is set out per damage and
command (``expected_codes``). The commands run in this process (fast) under a
watchdog, so a hang fails its case instead of the run; ``ckptfmt tui`` is
interactive and covered by its own tests (tests/tui/test_tui.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import warnings
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.cli import main
from ckptfmt.format import layout
from ckptfmt.repository.repository import Repository
from ckptfmt.storage.factory import open_storage
from tests.support.helpers import rewrite_manifest, within

EXCEPTION_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception|Warning)\b|Traceback")


def good_repo(root: Path) -> Path:
    repo = root / "repo"
    torch.manual_seed(0)
    ckptfmt.save({"w": torch.randn(300, 300), "b": torch.zeros(10), "step": 1}, repo / "a", step=1)
    ckptfmt.save({"w": torch.randn(300, 300), "b": torch.ones(10), "step": 2}, repo / "b", step=2)
    return repo


def chunk_of_w(repo: Path, name: str = "b") -> Path:
    """The chunk file of tensor ``w`` (its own chunk) of checkpoint ``name``."""
    with ckptfmt.open(repo / name) as reader:
        (shard,) = reader.tensor_info("w").shards
        chunk = reader.manifest.chunks[shard.pieces[0].chunk]
    return repo / layout.chunk_key(chunk.hash, chunk.codec)


def manifest_file(repo: Path, name: str = "b") -> Path:
    return repo / layout.manifest_key(name, Repository.open(repo).commit(name).manifest_hash)


def replace(path: Path, how: str) -> None:
    """Put something that is not the expected object where ``path`` was."""
    path.unlink()
    if how == "fifo":
        os.mkfifo(path)
    elif how == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif how == "folder":
        path.mkdir()
    elif how == "socket":
        server = socket.socket(socket.AF_UNIX)
        cwd = os.getcwd()
        os.chdir(path.parent)
        try:
            server.bind(path.name)
        finally:
            os.chdir(cwd)
    elif how == "garbage":
        path.write_bytes(b"\x00garbage\xff" * 10)
    elif how == "truncated":
        pass  # unlinked above: rewritten by the caller
    else:
        raise AssertionError(how)


def damage(repo: Path, what: str) -> None:
    if what == "strays":
        for name in ("CHUNKS", "Chunks", "notes", "empty"):
            (repo / name).mkdir()
        (repo / ".DS_Store").write_bytes(b"\0\1")
    elif what.startswith(("commit-", "manifest-", "chunk-", "marker-")):
        target, how = what.split("-", 1)
        path = {"commit": lambda: repo / "b" / layout.COMMIT_NAME, "manifest": lambda: manifest_file(repo),
                "chunk": lambda: chunk_of_w(repo), "marker": lambda: repo / layout.MARKER_KEY}[target]()
        if how == "missing":
            path.unlink()
        elif how == "truncated":
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
        elif how == "flipped":
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            replace(path, how)
    elif what == "newer-major":
        (repo / layout.MARKER_KEY).write_text(json.dumps({"format": "ckptfmt-repository", "version": [9, 0]}))
    elif what == "record-lies":
        record = json.loads((repo / "b" / layout.COMMIT_NAME).read_text())
        (repo / "b" / layout.COMMIT_NAME).write_text(json.dumps({**record, "manifest_size": 2**40, "name": "zz"}))
    elif what == "odd-metadata":
        rewrite_manifest(open_storage(repo), "b", lambda doc: doc.update(
            environment={"os": "plan9", "cpu": [1], "gpus": ["x"], "torch": 3, "determinism": "on"},
            topology={"world_size": "four", "ranks": {"0": 1}}, timing={"ranks": "fast", "steps": [None, "x"]},
            rng=[{"rank": "zero", "torch_cpu": 5}], stats={"tensor_count": "many", "stored_bytes": [1]}))
        record = json.loads((repo / "b" / layout.COMMIT_NAME).read_text())
        (repo / "b" / layout.COMMIT_NAME).write_text(json.dumps({**record, "stats": {"stored_bytes": "lots"}}))
    elif what == "chunks-dir-is-a-file":
        shutil.rmtree(repo / layout.CHUNKS_DIR)
        (repo / layout.CHUNKS_DIR).write_text("not a folder")
    elif what == "all-damaged":
        for name in ("a", "b"):
            (repo / name / layout.COMMIT_NAME).write_text("{")
    else:
        raise AssertionError(what)


DAMAGE = ["strays", "newer-major", "record-lies", "odd-metadata", "chunks-dir-is-a-file", "all-damaged"] + [
    f"{target}-{how}" for target in ("commit", "manifest", "chunk", "marker")
    for how in ("fifo", "/dev/zero", "folder", "socket", "garbage", "missing", "truncated")
] + ["chunk-flipped"]


def commands(repo: Path, out: Path, source: Path) -> list[tuple[str, list[str]]]:
    """(kind, argv) of every command run on each damaged repository; commands of a kind read the same."""
    a, b = str(repo / "a"), str(repo / "b")
    return [
        ("ls", ["ls", str(repo)]), ("ls", ["ls", str(repo), "--json"]),
        ("show b", ["show", b]), ("show b", ["show", b, "--json"]), ("show latest", ["show", str(repo)]),
        ("verify", ["verify", str(repo)]), ("verify b", ["verify", b]), ("verify", ["verify", str(repo), "--json"]),
        ("diff", ["diff", a, b]), ("diff", ["diff", b, a, "--json"]),
        ("export b", ["export", b, str(out / "x.pt"), "--format", "torch"]),
        ("export b", ["export", b, str(out / "x.safetensors"), "--format", "safetensors"]),
        ("export b", ["export", b, str(out / "dcp"), "--format", "dcp"]),
        ("export b as deepspeed", ["export", b, str(out / "ds"), "--format", "deepspeed"]),
        ("import", ["import", str(source), str(repo / "imported")]),
        ("protect", ["protect", str(repo), "--parity", "2+1"]),
    ]


#: Exit codes on an intact repository: b was not imported from DeepSpeed, so it has no DeepSpeed layout.
WORKS = {"ls": 0, "show b": 0, "show latest": 0, "verify": 0, "verify b": 0, "diff": 1, "export b": 0,
         "export b as deepspeed": 2, "import": 0, "protect": 0}  # diff: a and b differ


def expected_codes(what: str) -> dict[str, int]:
    """The exit code of each kind of command on a repository damaged by ``what``: 0 it works, 1 verify
    found damage (or diff a difference), 2 refused with one line."""
    target, _, how = what.partition("-")
    if what in ("strays", "odd-metadata"):  # ignored, and shown as text
        return WORKS
    if what == "newer-major" or target == "marker":  # nothing can be read without the marker
        return {**dict.fromkeys(WORKS, 2), "import": 0 if how == "missing" else 2,  # (a save writes a new one,
                "protect": 0 if how == "missing" else 2}  # which protect then finds)
    if what == "chunks-dir-is-a-file":  # every chunk missing: listing and metadata still work
        return {**WORKS, "verify": 1, "verify b": 1, "diff": 2, "export b": 2, "import": 2, "protect": 2}
    if target == "chunk":  # b's tensor w: protect refuses to protect damage
        return {**WORKS, "verify": 1, "verify b": 1, "diff": 2, "export b": 2, "protect": 2}
    if what == "commit-missing":  # b is no checkpoint, but the commit index names it: verify reports it
        return {**WORKS, "show b": 2, "verify": 1, "verify b": 2, "diff": 2, "export b": 2}
    # b's commit record or manifest (all-damaged: a's and b's records) cannot be read
    return {**WORKS, "show b": 2, "verify": 1, "verify b": 1, "diff": 2, "export b": 2, "protect": 2,
            "show latest": 2 if target == "manifest" or what == "all-damaged" else 0}  # the latest record is b's


def damaged_checkpoints(what: str) -> list[str]:
    """The checkpoints verify names as damaged."""
    return ["a", "b"] if what in ("all-damaged", "chunks-dir-is-a-file") else ["b"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("source") / "model.pt"
    torch.save({"w": torch.ones(4)}, path)
    return path


@pytest.mark.parametrize("what", DAMAGE)
def test_every_command_fails_cleanly_or_works(tmp_path, capsys, monkeypatch, source, what):
    monkeypatch.setenv("COLUMNS", "100")
    repo = good_repo(tmp_path)
    damage(repo, what)
    out = tmp_path / "out"
    out.mkdir()
    outcomes, expected = {}, {}
    for kind, argv in commands(repo, out, source):
        with warnings.catch_warnings(record=True) as leaked:
            warnings.simplefilter("always")
            code = within(60, lambda: main(argv))
        captured = capsys.readouterr()
        text = captured.out + captured.err
        where = f"{what}: ckptfmt {' '.join(argv)} -> {code}\n{text[-2000:]}"
        assert not EXCEPTION_NAME.search(text), where
        assert [str(w.message) for w in leaked] == [], where  # warnings reach the user as ckptfmt's lines
        assert all(line.startswith("ckptfmt: warning: ") for line in captured.err.splitlines()
                   if line.strip() and code == 0), where
        if code == 2:
            lines = [line for line in captured.err.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("ckptfmt: error: "), where
            assert "unexpected failure" not in lines[0], where
        if code == 1:  # found something: damage (verify), a difference (diff)
            assert argv[0] in ("verify", "diff") and not captured.err.strip(), where
            if "--json" in argv and argv[0] == "verify":
                problems = json.loads(captured.out)["problems"]
                assert sorted({p["checkpoint"] for p in problems}) == damaged_checkpoints(what), where
                if what.startswith("chunk-"):
                    assert [p["tensors"] for p in problems] == [["w"]], where
        name = " ".join(argv).replace(str(repo), "REPO").replace(str(out), "OUT").replace(str(source), "SOURCE")
        outcomes[name], expected[name] = code, expected_codes(what)[kind]
    assert outcomes == expected
