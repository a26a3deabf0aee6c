"""Writing for older readers, measured against the readers themselves (spec 13.3): for every format version
1.N, today's ckptfmt saves with ``format_version="1.N"`` a rich state limited to what 1.N expresses, and the
ckptfmt of the commit that introduced 1.N (tests/support/old_trees.py) lists, verifies and loads every
checkpoint and finds every tensor and plain value bit for bit as saved, and its ``restore_rng`` puts the
generators where the saving process had them (this found the floor 1.13 writing Python's generator state
in a form that 1.13's own commit cannot restore: tests/format/test_floor_forms.py). A checkpoint and
repository of the default format 2.x are refused by every 1.x tree as "upgrade" (an
UnsupportedVersionError naming it), never misread as damage. Exhaustive: 16 old trees, one process
each, and 6 collective saves on 2 ranks (about 90 seconds on 2 idle cores, under 3 minutes on busy ones).

The helpers here are shared with tests/support/compat_matrix.py, which prints the compatibility table of
docs/compatibility.md.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptfmt
from ckptfmt.format.version import FORMAT_VERSION
from tests.corpus import typed_json
from tests.corpus.generate import VERSIONS
from tests.support.old_trees import ROOT, run_in_tree

sys.modules.setdefault("typed_json", typed_json)  # writer.py imports it by its bare name (it runs in old trees)
from tests.corpus import writer

#: Old trees read at once (the machine's cores).
PARALLEL = 2
#: The format-1 versions: today's writer writes each for its own tree (2.x is today's own).
FLOORS = [version for version in VERSIONS if version.startswith("1.")]
#: The floors that also get collective saves (2 ranks): the first with per-rank values, the first with
#: replica divergence records, the last and the first with shard grids, the first with node scope, the
#: last with grids as rows.
COLLECTIVE = ("1.1", "1.4", "1.5", "1.6", "1.10", "1.13")
#: The folder of typed_json.py, which the reader program imports (it imports no ckptfmt).
CORPUS = Path(typed_json.__file__).resolve().parent


def numbers(version: str) -> tuple[int, int]:
    major, minor = version.split(".")
    return int(major), int(minor)


# -- today's writer ----------------------------------------------------------------------------------------------
def save_floor(version: str | None, repo: Path, key: Path | None) -> dict:
    """Today's ckptfmt saves into ``repo`` with ``format_version=version`` (None: the default, 2.0) every
    checkpoint that version expresses, and returns what it saved: per checkpoint, as tests/corpus's
    writer describes it (typed JSON of the state as a load returns it, each tensor's sha256, codecs, step),
    and the public key that signed it, if any. ``key``: a private key (PEM) to sign with from 1.7."""
    target = numbers(version) if version else ckptfmt.FORMAT_VERSION
    has = {feature: target >= since for feature, since in writer.SINCE.items()}
    floor = {"format_version": version} if version else {}
    out: dict = {}

    def save(name: str, state: dict, step: int, compression: str | None, **options: Any) -> None:
        url = ckptfmt.save(state, f"{repo}/{name}", step=step, metadata=writer.METADATA, compression=compression,
                           **floor, **options)
        key_id = ckptfmt.SigningKey.load(options["signer"]).key_id if "signer" in options else None
        out[name] = writer.describe(url, writer.as_loaded(state), key_id)
        out[name]["trusted"] = f"{options['signer']}.pub" if "signer" in options else None

    signed = {"signer": str(key)} if key and has["signatures"] else {}
    no_rng = {"rng": []} if has["rng_argument"] else {}
    values = writer.values_state(target)
    values.setdefault("sharded", writer.sharded_tensors())  # at 1.0 too: shard lists (the 1.0 writer had no API)
    seed_generators(target[1])
    save("values", values, 1, None, **signed)  # this process's RNG states: the RNG form
    seed_generators(target[1])
    out["values"]["rng"] = draws()  # what a restore of the values checkpoint's RNG states draws next
    save("shuffle", writer.codec_state(False, 2), 2, "shuffle-zstd", **no_rng)
    if has["delta_codecs"]:
        save("delta", writer.codec_state(True, 3), 3, "delta-zstd", **no_rng)
    if has["float_codecs"]:
        save("float", writer.codec_state(False, 4), 4, "float-zstd", **no_rng)
        save("float-delta", writer.codec_state(True, 5), 5, "auto", **no_rng)
    else:  # "auto" picks within the version: deltas from 1.5, no float codec
        save("auto", writer.codec_state(True, 6), 6, "auto", **no_rng)
    # Tensors over several chunks (64 KiB each), stored against the parent's chunks of another size.
    save("chunked", writer.codec_state(False, 7), 7, "auto", chunk_size=65536, **no_rng)
    return out


#: One rank of a collective save by today's ckptfmt (argv: tests/corpus, version, repo, file store, rank,
#: world): the corpus writer's collective state (a replicated tensor, DTensors sharded by rows and by
#: columns: a shard grid from 1.6, a per-rank value), and from 1.10 the same with scope="node". Rank 0
#: prints what was saved.
RANK = r"""
import json, sys
from datetime import timedelta
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
import ckptfmt
import writer

version, repo, store, rank, world = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=60))
state, loaded = writer.collective_state(rank)
out = {}
for name, step, options in (("collective", 8, {}), ("node", 9, {"scope": "node"})):
    if name == "node" and tuple(map(int, version.split("."))) < writer.SINCE["node_scope"]:
        continue
    url = ckptfmt.save(state, f"{repo}/{name}", step=step, metadata=writer.METADATA, timeout=60, rng=[],
                       format_version=version, **options)
    if rank == 0:
        out[name] = {**writer.describe(url, loaded), "trusted": None}
dist.destroy_process_group()
sys.stdout.write(json.dumps(out))
"""


def save_collective(version: str, repo: Path, store: Path) -> dict:
    """Today's ckptfmt saves the collective checkpoints for ``version`` on writer.WORLD gloo ranks, each a
    process of its own; returns what rank 0 says was saved."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", RANK, str(CORPUS), version, str(repo), str(store)]
    ranks = [subprocess.Popen([*command, str(rank), str(writer.WORLD)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(writer.WORLD)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    for rank, (_, stderr) in zip(ranks, outputs):
        assert rank.returncode == 0, stderr[-4000:]
    return json.loads(outputs[0][0])


def seed_generators(seed: int) -> None:
    """Put the Python, numpy and torch generators in a known state."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def draws() -> dict:
    """The next value of each generator, exactly (float.hex)."""
    return {"python": random.random().hex(), "numpy": float(np.random.random()).hex(),
            "torch": torch.rand(1, dtype=torch.float64).item().hex()}


def corpus_written(version: str) -> dict:
    """What the 1.N tree's own writer saved in tests/corpus/v1.N (its expected.json's checkpoints), with the
    corpus test key's public half as the trusted key of a signed one."""
    expected = json.loads((CORPUS / f"v{version}" / "expected.json").read_text())
    public = CORPUS / "keys" / "corpus-test-key.pem.pub"
    return {name: {**written, "trusted": str(public) if written["signed_by"] else None}
            for name, written in expected["checkpoints"].items()}


# -- a reader: an old tree's or today's ---------------------------------------------------------------------------
#: Run under a tree: argv[1] is typed_json's folder, argv[2] a JSON list of jobs {"repo", "names": {name:
#: trusted public key or null}}. For each job it lists the repository's commits, verifies it (and each
#: signed checkpoint with its key), loads and opens each named checkpoint, restores the RNG states of those
#: in "rng" and draws from each generator, and prints, for each step, what it
#: found or the exception (class and message): the reader's side of the comparison. API used: that of 1.0,
#: plus ``trusted_keys`` for a signed checkpoint where the tree has it (1.7 on; before, no key is checked).
READER = r"""
import inspect, json, random, sys
sys.path.append(sys.argv[1])
import numpy as np
import torch
import typed_json
import ckptfmt

SIGNATURES = "trusted_keys" in inspect.signature(ckptfmt.load).parameters
RNG_TRUST = "trusted_keys" in inspect.signature(ckptfmt.restore_rng).parameters

def attempt(step):
    try:
        return {"ok": step()}
    except Exception as exc:
        return {"error": [type(exc).__name__, str(exc)]}

def commits(repo):
    return [record.name for record in ckptfmt.Repository.open(repo).commits()]

STATS = {"stats": True} if "stats" in inspect.signature(ckptfmt.verify).parameters else {}

def verify(url, **keys):
    report = ckptfmt.verify(url, **STATS, **keys)
    return {"ok": report.ok, "checkpoints": sorted(report.checkpoints),
            "problems": [f"{p.kind}: {p.message}" for p in report.problems][:5],
            "warnings": list(getattr(report, "warnings", []))[:5]}

def read(url, **keys):
    found = {}
    state = typed_json.encode(ckptfmt.load(url, **keys), found)
    tensors, first = {}, {}
    for key, tensor in found.items():
        tensors[key] = typed_json.describe_tensor(tensor)
        if id(tensor) in first:
            tensors[key]["same_as"] = first[id(tensor)]
        first.setdefault(id(tensor), key)
    with ckptfmt.open(url, **keys) as reader:
        listed = reader.keys()
        codecs = sorted({chunk.codec for chunk in reader.manifest.chunks})
        meta = reader.metadata
    return {"state": state, "tensors": tensors, "keys": listed, "codecs": codecs, "step": meta["step"],
            "format_version": meta["format_version"], "metadata": typed_json.encode(meta["user"])}

def restored(url, **keys):
    ckptfmt.restore_rng(url, rank=0, **(keys if RNG_TRUST else {}))
    return {"python": random.random().hex(), "numpy": float(np.random.random()).hex(),
            "torch": torch.rand(1, dtype=torch.float64).item().hex()}

results = []
for job in json.loads(sys.argv[2]):
    repo = job["repo"]
    found = {"commits": attempt(lambda: commits(repo)), "verify": attempt(lambda: verify(repo)), "checkpoints": {}}
    for name, trusted in job["names"].items():
        keys = {"trusted_keys": [trusted]} if trusted and SIGNATURES else {}
        found["checkpoints"][name] = attempt(lambda: read(f"{repo}/{name}", **keys))
        if name in job["rng"]:
            found["checkpoints"][name]["rng"] = attempt(lambda: restored(f"{repo}/{name}", **keys))
        if keys:
            found["checkpoints"][name]["verify"] = attempt(lambda: verify(f"{repo}/{name}", **keys))
    results.append(found)
sys.stdout.write(json.dumps(results))
sys.stdout.flush()
"""


def jobs_for(repos: list[tuple[Path, dict]]) -> str:
    return json.dumps([{"repo": str(repo), "names": {name: written["trusted"] for name, written in saved.items()},
                        "rng": [name for name, written in saved.items() if "rng" in written]}
                       for repo, saved in repos])


def read_in_tree(version: str, repos: list[tuple[Path, dict]], timeout: float = 300) -> list[dict]:
    """What the ckptfmt of format ``version``'s commit finds in each (repository, what was saved in it)."""
    return run_in_tree(VERSIONS[version], READER, str(CORPUS), jobs_for(repos), timeout=timeout)


def read_today(repos: list[tuple[Path, dict]], timeout: float = 300) -> list[dict]:
    """The same reader program, run by today's ckptfmt (this venv's install) in a process of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", READER, str(CORPUS), jobs_for(repos)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(result.stdout)


def read_everywhere(readers: list[str], repos: list[tuple[Path, dict]]) -> dict[str, list[dict]]:
    """Each reader ("1.N": that tree's, "today") on every repository, PARALLEL trees at a time."""
    def one(reader: str) -> list[dict]:
        return read_today(repos) if reader == "today" else read_in_tree(reader, repos)

    with ThreadPoolExecutor(PARALLEL) as pool:
        return dict(zip(readers, pool.map(one, readers)))


# -- comparing -----------------------------------------------------------------------------------------------------
def mismatches(found: dict, saved: dict) -> list[str]:
    """What a reader found in a repository that differs from what was saved in it: [] when it listed every
    checkpoint in order, verified the repository and each signed checkpoint, and loaded each bit for bit."""
    wrong = []
    if found["commits"] != {"ok": list(saved)}:
        wrong.append(f"commits: {found['commits']}")
    verified = found["verify"].get("ok")
    if not (verified and verified["ok"] and verified["checkpoints"] == sorted(saved)):
        wrong.append(f"verify: {found['verify']}")
    for name, written in saved.items():
        got = found["checkpoints"][name]
        if "error" in got:
            wrong.append(f"{name}: {got['error']}")
            continue
        read = got["ok"]
        expected_tensors = dict(written["tensors"])
        for field in ("state", "step", "format_version", "metadata", "codecs"):
            if read[field] != written[field]:
                wrong.append(f"{name}: {field} differs")
        if read["tensors"] != expected_tensors:
            differ = sorted(k for k in set(read["tensors"]) | set(expected_tensors)
                            if read["tensors"].get(k) != expected_tensors.get(k))
            wrong.append(f"{name}: tensors differ: {differ[:8]}")
        if read["keys"] != list(expected_tensors):
            wrong.append(f"{name}: keys listed differ")
        if "rng" in written and got["rng"] != {"ok": written["rng"]}:
            wrong.append(f"{name}: restored RNG states draw {got['rng']}, not {written['rng']}")
        checked = got.get("verify", {}).get("ok") or {}
        if "verify" in got and (checked.get("ok"), checked.get("checkpoints"), checked.get("problems")) != (
                True, [name], []):
            wrong.append(f"{name}: signed verify: {got['verify']}")
    return wrong


def first_error(found: dict) -> tuple[str, str] | None:
    """The exception of the first step that raised one (listing, verify, a checkpoint's load), if any."""
    for step in (found["commits"], found["verify"], *found["checkpoints"].values()):
        if "error" in step:
            return tuple(step["error"])  # type: ignore[return-value]
    return None


def is_refusal(error: tuple[str, str]) -> bool:
    """An error that says the data is newer than the reader ("upgrade"), not that it is damaged."""
    kind, message = error
    return kind == "UnsupportedVersionError" and "upgrade" in message


def cell(found: dict, saved: dict) -> str:
    """A compatibility-table cell: "reads bit-exactly", "refuses: <message>" or "fails: <what>"."""
    wrong = mismatches(found, saved)
    if not wrong:
        return "reads bit-exactly"
    error = first_error(found)
    if error and is_refusal(error):
        return f"refuses: {error[0]}: {error[1]}"
    if error:
        return f"fails: {error[0]}: {error[1]}"
    return f"fails: {wrong[0]}"


# -- the tests -----------------------------------------------------------------------------------------------------
def with_marker_of(repo: Path, copy: Path, version: tuple[int, int]) -> Path:
    """A copy of ``repo`` whose marker declares ``version`` (1.x: no ``requires``): what a reader finds past
    the marker, in its commit records and manifests."""
    shutil.copytree(repo, copy)
    doc = json.loads((copy / "ckptfmt.json").read_text())
    doc["version"] = list(version)
    doc.pop("requires", None)
    (copy / "ckptfmt.json").write_text(json.dumps(doc))
    return copy


def refusal(tree: str, where: str) -> list[str]:
    """What the 1.x tree ``tree`` raises for an object of today's format 2.x at ``where`` (measured: the same
    words from 1.0 to 1.15)."""
    written = f"{FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}"
    return ["UnsupportedVersionError",
            f"{where}: format version {written} is not readable by this ckptfmt (reads 1.x); upgrade ckptfmt"]


def signed_and_checked(tree: str, saved: dict) -> list[str]:
    """The signed checkpoints that the reader program verifies with their key under ``tree`` (1.7 on)."""
    return [name for name, written in saved.items() if written["trusted"] and numbers(tree) >= (1, 7)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """Today's writer at every floor and at the default, each into a fresh repository; then each floor's own
    tree reads its floor's repository, the default one, and a copy of that whose marker says 1.0 (one
    process per tree), and today's reader reads them all."""
    scratch = tmp_path_factory.mktemp("matrix")
    key = scratch / "signing.pem"
    ckptfmt.generate_key(key)
    saved = {version: (scratch / f"floor-{version}", save_floor(version, scratch / f"floor-{version}", key))
             for version in FLOORS}
    for version in COLLECTIVE:
        repo, written = saved[version]
        written.update(save_collective(version, repo, scratch / f"store-{version}"))
    default = (scratch / "default", save_floor(None, scratch / "default", key))
    past_marker = (with_marker_of(default[0], scratch / "marker-1.0", (1, 0)), default[1])

    def one(version: str) -> list[dict]:
        return read_in_tree(version, [saved[version], default, past_marker])

    with ThreadPoolExecutor(PARALLEL) as pool:
        old = dict(zip(FLOORS, pool.map(one, FLOORS)))
    today = read_today([*saved.values(), default])
    return {"saved": saved, "default": default, "past_marker": past_marker, "old": old,
            "today": dict(zip([*FLOORS, None], today))}


@pytest.mark.exhaustive
@pytest.mark.parametrize("version", FLOORS)
def test_the_floors_own_tree_reads_what_today_writes_for_it_bit_for_bit(measured, version):
    repo, saved = measured["saved"][version]
    assert {tuple(written["format_version"]) for written in saved.values()} == {numbers(version)}
    found = measured["old"][version][0]
    assert mismatches(found, saved) == []
    # The 1.1 and 1.2 trees (before the leases of 1.3) note the folder they skip; a repository made for them
    # keeps no commit index.
    skipped = ["ignored 1 entries that are not committed checkpoints (foreign files, invalid names or unfinished "
               "saves): _leases"] if version in ("1.1", "1.2") else []
    assert found["verify"]["ok"]["warnings"] == skipped
    assert ("collective" in saved, "node" in saved) == (version in COLLECTIVE,
                                                        version in COLLECTIVE and numbers(version) >= (1, 10))
    signed = [name for name, written in saved.items() if written["signed_by"]]
    assert signed == (["values"] if numbers(version) >= (1, 7) else [])
    assert all("verify" in found["checkpoints"][name] for name in signed)  # checked with the key, by the tree


@pytest.mark.exhaustive
@pytest.mark.parametrize("version", FLOORS)
def test_every_old_tree_refuses_a_default_repository_at_its_marker_as_newer(measured, version):
    """Listing, verify and every checkpoint's load: an UnsupportedVersionError that names format 2.0 and
    says to upgrade, raised by the repository marker before any checkpoint is parsed, never a damage error."""
    repo, saved = measured["default"]
    found = measured["old"][version][1]
    expected = {"error": refusal(version, f"{repo}/ckptfmt.json")}
    assert found["commits"] == expected
    assert found["verify"] == expected
    assert {name: got.get("error") for name, got in found["checkpoints"].items()} == {
        name: expected["error"] for name in saved}
    assert [got["verify"] for got in found["checkpoints"].values() if "verify" in got] == [
        expected for _ in signed_and_checked(version, saved)]


@pytest.mark.exhaustive
@pytest.mark.parametrize("version", FLOORS)
def test_past_the_marker_every_old_tree_refuses_each_checkpoint_at_its_commit_record(measured, version):
    """Were the marker to say 1.0 (it never does once a 2.0 checkpoint is committed), each load is still
    refused as newer, at the commit record, and verify reports that refusal, not damage."""
    repo, saved = measured["past_marker"]
    found = measured["old"][version][2]
    refused = {name: refusal(version, f"{repo}/{name}/COMMIT: commit record") for name in saved}
    assert {name: got.get("error") for name, got in found["checkpoints"].items()} == refused
    assert found["verify"]["ok"]["problems"] == [f"bad-checkpoint: {refused[name][1]}" for name in sorted(saved)][:5]
    assert [got["verify"]["ok"]["problems"] for got in found["checkpoints"].values() if "verify" in got] == [
        [f"bad-checkpoint: {refused[name][1]}"] for name in signed_and_checked(version, saved)]


@pytest.mark.exhaustive
@pytest.mark.parametrize("version", FLOORS)
def test_todays_reader_reads_what_each_floor_wrote(measured, version):
    assert mismatches(measured["today"][version], measured["saved"][version][1]) == []


@pytest.mark.exhaustive
def test_todays_reader_reads_the_default(measured):
    repo, saved = measured["default"]
    assert {tuple(written["format_version"]) for written in saved.values()} == {ckptfmt.FORMAT_VERSION}
    assert mismatches(measured["today"][None], saved) == []


@pytest.mark.exhaustive
def test_the_latest_of_a_floor_1_2_repository_is_what_a_1_2_writer_saved_last(tmp_path):
    """A repository created for format 1.2 keeps no commit index (1.3), which a 1.2 writer would not update."""
    repo = tmp_path / "repo"
    ckptfmt.save({"w": torch.ones(2)}, f"{repo}/today", format_version="1.2")
    saved = run_in_tree(VERSIONS["1.2"], "import json, sys, torch, ckptfmt\n"
                        "ckptfmt.save({'w': torch.zeros(2)}, sys.argv[1])\nprint(json.dumps('saved'))", f"{repo}/old")
    assert saved == "saved"
    assert [record.name for record in ckptfmt.Repository.open(repo).commits()] == ["today", "old"]
    assert ckptfmt.Repository.open(repo).latest_record().name == "old"
