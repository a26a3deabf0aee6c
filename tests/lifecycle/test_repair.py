"""Self-healing. ckptfmt repair: damaged or missing chunks, manifests and commit records of a local
repository replaced with verified copies from another tier on the S3 test server; what cannot be repaired
is named; a repair killed midway leaves nothing worse than it found. Reads that heal: restore() and
load(heal_from=...) read a damaged chunk from the other tier, the rest from the fast one, and repair it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import fsspec
import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointManager
from ckptfmt.cli import main
from ckptfmt.format import layout
from ckptfmt.lifecycle.repair import repair
from ckptfmt.lifecycle.replicate import replicate
from ckptfmt.storage.base import Storage
from ckptfmt.tools.verify import verify
from tests.support.helpers import assert_bits, script_env

pytestmark = pytest.mark.s3


def states() -> list[dict]:
    """Three steps of a small training state: fp32 and bf16 tensors, some of them unchanged between steps."""
    torch.manual_seed(0)
    frozen = torch.randn(64, 32)
    out = []
    for step in range(3):
        out.append({"model": {"w": torch.randn(256, 384), "frozen": frozen, "b": torch.randn(384).bfloat16()},
                    "optim": {"exp_avg": torch.randn(256, 384)}, "step": step})
    return out


@pytest.fixture
def tiers(tmp_path, s3_bucket) -> tuple[str, str]:
    """A local fast tier and its replica on S3, three checkpoints each (chunks of 32 KiB: a few dozen)."""
    fast, slow = str(tmp_path / "fast"), f"{s3_bucket}/slow"
    for step, state in enumerate(states()):
        ckptfmt.save(state, f"{fast}/step-{step}", step=step, chunk_size=32768)
    replicate(fast, slow)
    return fast, slow


def chunk_files(repo: str) -> list[Path]:
    return sorted(p for p in Path(repo, "chunks").rglob("*") if p.is_file())


def damage(repo: str) -> dict[str, str]:
    """Delete, truncate and bit-flip chunks, flip a byte of a manifest, garble a commit record and delete
    another: {what was done: the path}."""
    chunks = chunk_files(repo)
    done = {"deleted": chunks[0], "truncated": chunks[5], "flipped": chunks[9]}
    done["deleted"].unlink()
    with open(done["truncated"], "r+b") as f:
        f.truncate(100)
    flip(done["flipped"], 77)
    done["manifest"] = next(Path(repo, "step-0").glob("manifest-*"))
    flip(done["manifest"], 40)
    done["garbled-commit"] = Path(repo, "step-1", "COMMIT")
    done["garbled-commit"].write_bytes(b'{"not": "a commit record"}')
    done["lost-commit"] = Path(repo, "step-2", "COMMIT")
    done["lost-commit"].unlink()
    return {kind: str(path) for kind, path in done.items()}


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_repair_from_s3_restores_every_object_and_the_checkpoints_load_bit_exact(tiers):
    fast, slow = tiers
    damaged = damage(fast)
    assert not verify(fast).ok

    report = repair(fast, [slow])

    assert report.ok and report.verified is not None and report.verified.ok
    assert report.checkpoints == ["step-0", "step-1", "step-2"]  # step-2 had lost its commit record
    fixed = {(f.kind, os.path.join(fast, f.key)) for f in report.fixed}
    assert {("chunk", damaged[k]) for k in ("deleted", "truncated", "flipped")} <= fixed
    assert ("manifest", damaged["manifest"]) in fixed
    assert {("commit-record", damaged["garbled-commit"]), ("commit-record", damaged["lost-commit"])} <= fixed
    assert all(f.source.startswith(f"{slow}/") for f in report.fixed)
    assert verify(fast).ok
    for step, state in enumerate(states()):
        loaded = ckptfmt.load(f"{fast}/step-{step}")
        for key in ("w", "frozen", "b"):
            assert_bits(loaded["model"][key], state["model"][key], f"step-{step} {key}")
        assert_bits(loaded["optim"]["exp_avg"], state["optim"]["exp_avg"])


def test_dry_run_reports_the_same_repairs_and_writes_nothing(tiers):
    fast, slow = tiers
    damage(fast)
    before = {p: p.read_bytes() for p in Path(fast).rglob("*") if p.is_file()}

    planned = repair(fast, [slow], dry_run=True)

    assert {p: p.read_bytes() for p in Path(fast).rglob("*") if p.is_file()} == before
    assert planned.dry_run and planned.verified is None and not planned.unrepaired
    assert sorted((f.kind, f.key) for f in planned.fixed) == sorted((f.kind, f.key) for f in repair(fast, [slow]).fixed)


def test_a_chunk_stored_compressed_elsewhere_is_decoded_checked_and_stored_as_this_repository_keeps_it(tmp_path):
    fast, other = str(tmp_path / "fast"), str(tmp_path / "zstd")
    state = states()[0]
    ckptfmt.save(state, f"{fast}/a", chunk_size=32768)
    ckptfmt.save(state, f"{other}/b", chunk_size=32768, compression="zstd")  # another checkpoint, same chunks
    lost = chunk_files(fast)[3]
    original = lost.read_bytes()
    lost.unlink()

    report = repair(fast, [other])

    assert report.ok and [(f.kind, f.source.endswith(".zstd")) for f in report.fixed] == [("chunk", True)]
    assert lost.read_bytes() == original


def test_another_checkpoint_of_the_same_name_is_never_taken_for_it(tmp_path):
    """The other repository's step-0 was saved separately: its commit record would make a different
    checkpoint of ours, so a garbled record stays unrepaired, named, rather than replaced by it."""
    fast, other = str(tmp_path / "fast"), str(tmp_path / "other")
    ckptfmt.save(states()[0], f"{fast}/step-0", step=0)
    ckptfmt.save(states()[1], f"{other}/step-0", step=0)
    Path(fast, "step-0", "COMMIT").write_bytes(b"garbage")

    report = repair(fast, [other])

    assert not report.ok and not report.fixed
    assert [(u.kind, u.checkpoint) for u in report.unrepaired] == [("checkpoint", "step-0")]
    assert "another checkpoint of that name" in report.unrepaired[0].tried
    assert Path(fast, "step-0", "COMMIT").read_bytes() == b"garbage"


def test_cli_names_what_has_no_good_copy_and_exits_1(tiers, capsys):
    fast, slow = tiers
    lost = chunk_files(fast)[2]
    lost.unlink()
    key = str(lost.relative_to(fast))
    s3 = fsspec.filesystem("s3")  # the S3 copy is lost too
    s3.rm_file(f"{slow}/{key}")
    s3.invalidate_cache()

    assert main(["repair", fast, "--from", slow, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and out["repaired"] == []
    assert {u["key"] for u in out["unrepaired"]} == {key}
    assert all(u["tensors"] for u in out["unrepaired"])  # each names the tensors the chunk holds
    assert "no other copy of the chunk" in out["unrepaired"][0]["tried"]

    assert main(["repair", fast]) == 1
    text = capsys.readouterr().out
    assert "no good copy" in text and "no other copy of the chunk" in text


def test_cli_repairs_and_says_the_repository_verifies(tiers, capsys):
    fast, slow = tiers
    chunk_files(fast)[4].unlink()
    assert main(["repair", fast, "--from", slow]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "repaired 1 object" in first and "the repository verifies" in first
    assert main(["repair", fast]) == 0  # nothing damaged: no source needed
    assert main(["repair", fast, "--from", slow]) == 0
    assert "nothing damaged" in capsys.readouterr().out


#: A repair that stops for good after writing argv[3] objects (its lease aside), waiting to be killed.
KILLED_REPAIR = """
import sys, time
from pathlib import Path
from ckptfmt.storage.base import Storage
from ckptfmt.storage.local import LocalStorage
from ckptfmt.lifecycle.repair import repair

written = 0
for cls in (Storage, LocalStorage):
    original = cls.write
    def write(self, key, data, *, durable=True, _original=original):
        global written
        if key.startswith("_leases/"):
            return _original(self, key, data, durable=durable)
        if written == int(sys.argv[3]):
            Path(sys.argv[4]).write_text("stopped")
            time.sleep(600)
        _original(self, key, data, durable=durable)
        written += 1
    cls.write = write
repair(sys.argv[1], [sys.argv[2]], workers=1)
"""


def files(repo: str) -> dict[str, bytes]:
    """Every file of a repository but its leases, by path inside it."""
    return {str(p.relative_to(repo)): p.read_bytes() for p in Path(repo).rglob("*")
            if p.is_file() and "_leases" not in p.parts}


@pytest.mark.parametrize("kill_after", [2])
def test_a_repair_killed_midway_leaves_nothing_worse_and_the_next_one_finishes(tiers, tmp_path, kill_after):
    """Every object of the killed repair's repository is as it was or as a whole repair makes it."""
    fast, slow = tiers
    damage(fast)
    before = files(fast)
    reference = str(tmp_path / "reference")
    shutil.copytree(fast, reference)
    assert repair(reference, [slow]).ok
    repaired = files(reference)
    signal_file = tmp_path / "stopped"
    process = subprocess.Popen([sys.executable, "-c", KILLED_REPAIR, fast, slow, str(kill_after), str(signal_file)],
                               env=script_env())
    try:
        deadline = time.monotonic() + 120
        while not signal_file.exists():
            assert process.poll() is None, f"the repair ended (exit {process.returncode}) before it was stopped"
            assert time.monotonic() < deadline, "the repair never reached its stopping point"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait(timeout=60)

    after = files(fast)
    assert set(after) <= set(before) | set(repaired)
    assert all(data in (before.get(path), repaired.get(path)) for path, data in after.items())
    assert sum(before.get(path) != data for path, data in after.items()) == kill_after
    assert repair(fast, [slow]).ok and verify(fast).ok


# -- reads that heal: restore() and load(heal_from=...) ---------------------------------------------------


def managed_tiers(tmp_path, s3_bucket) -> tuple[str, str]:
    """Three steps saved by a manager on a local tier, replicated to S3 (4 chunks a big tensor)."""
    fast, slow = str(tmp_path / "fast"), f"{s3_bucket}/slow"
    with CheckpointManager(tiers=[fast, slow], housekeeping="thread", chunk_size=2**17) as manager:
        for step, state in enumerate(states()):
            manager.save(step, state)
        manager.wait()
    return fast, slow


def test_restore_reads_damaged_chunks_from_the_next_tier_and_repairs_the_fast_copy(tmp_path, s3_bucket):
    fast, slow = managed_tiers(tmp_path, s3_bucket)
    newest = Path(fast, "step-000000002")
    used = {layout.chunk_key(c.hash, c.codec) for c in ckptfmt.open(str(newest)).manifest.chunks}
    chunks = [p for p in chunk_files(fast) if str(p.relative_to(fast)) in used]
    chunks[0].unlink()
    with open(chunks[1], "r+b") as f:
        f.truncate(10)
    flip(chunks[2], 1000)
    state = states()[2]
    into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "optim": {"exp_avg": torch.zeros_like(state["optim"]["exp_avg"])}, "step": -1}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(tiers=[fast, slow], housekeeping="thread") as manager:
            manager.restore(into=into)
            assert manager.start_step == 3

    healed = [str(w.message) for w in caught if "read from" in str(w.message)]
    assert len(healed) == 3 and all(f"read from {slow}/chunks/" in m for m in healed)
    for key in ("w", "frozen", "b"):
        assert_bits(into["model"][key], state["model"][key], key)
    assert_bits(into["optim"]["exp_avg"], state["optim"]["exp_avg"])
    assert verify(fast).ok  # the fast tier's copies were repaired


def test_with_no_good_copy_anywhere_the_error_names_checkpoint_tensor_and_chunk(tmp_path, s3_bucket):
    fast, slow = managed_tiers(tmp_path, s3_bucket)
    url = f"{fast}/step-000000002"
    with ckptfmt.open(url) as reader:
        piece = reader.tensor_info("model/w").shards[0].pieces[0]
        chunk = reader.manifest.chunks[piece.chunk]
    key = layout.chunk_key(chunk.hash, chunk.codec)
    Path(fast, key).unlink()
    s3 = fsspec.filesystem("s3")
    s3.rm_file(f"{slow}/{key}")
    s3.invalidate_cache()

    with pytest.raises(ckptfmt.CheckpointError) as error:
        ckptfmt.load(url, heal_from=[slow])
    message = str(error.value)
    assert all(part in message for part in (url, "'model/w'", chunk.hash, "no good copy elsewhere"))
    with pytest.raises(ckptfmt.CheckpointError, match="no tier has a readable copy"), \
            pytest.warns(ckptfmt.CheckpointWarning, match=f"restoring step 2 from {slow}: "):
        CheckpointManager(tiers=[fast, slow], housekeeping="thread").restore()


def test_load_heals_a_memory_mapped_chunk_and_reads_nothing_else_from_the_other_tier(tmp_path, s3_bucket):
    """Whole tensors in one uncompressed chunk are memory-mapped (the default on a local disk): a damaged
    one is read from the other tier into memory instead."""
    fast, slow = str(tmp_path / "fast"), f"{s3_bucket}/slow"
    state = states()[0]
    ckptfmt.save(state, f"{fast}/a")
    replicate(fast, slow)
    with ckptfmt.open(f"{fast}/a") as reader:
        chunk = reader.manifest.chunks[reader.tensor_info("model/w").shards[0].pieces[0].chunk]
    key = layout.chunk_key(chunk.hash, chunk.codec)
    flip(Path(fast, key), 5)
    read_from_s3 = []
    original = Storage.read

    def counting_read(self, key, **kwargs):
        read_from_s3.extend([key] if self.url.startswith("s3://") and key.startswith("chunks/") else [])
        return original(self, key, **kwargs)

    with pytest.MonkeyPatch.context() as patch, pytest.warns(ckptfmt.CheckpointWarning, match="read from"):
        patch.setattr(Storage, "read", counting_read)
        loaded = ckptfmt.load(f"{fast}/a", heal_from=[slow])
    assert_bits(loaded["model"]["w"], state["model"]["w"])
    assert_bits(loaded["optim"]["exp_avg"], state["optim"]["exp_avg"])
    assert read_from_s3 == [key]
    assert verify(fast).ok
