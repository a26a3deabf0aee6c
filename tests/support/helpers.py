"""Helpers shared by the test modules: exact comparisons and chunk bookkeeping."""

from __future__ import annotations

import importlib
import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from ckptfmt.format import layout
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.storage.factory import open_storage
from tests.support import exit_check, markers
from tests.support.spec_reader import chunk_rows, tensor_rows

#: The programs the tests launch (tests/scripts/).
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

#: A size bound for tests that read whole objects back (``Storage.read`` always takes one).
ANY_SIZE = 2**40
#: Set by .ci/run: there a test tool or package that is missing fails the run instead of skipping.
IN_CI = os.environ.get("CKPTFMT_CI") == "1"


def require_module(name: str, reason: str | None = None):
    """The test-only module ``name``; skips the caller without it, except under CI, where it errors."""
    if IN_CI:
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=reason)


def needs_tool(found: object, reason: str):
    """A mark that skips a test when a test tool is absent (``found`` is falsy), except under CI, where
    the test runs and fails for want of it."""
    return pytest.mark.skipif(not found and not IN_CI, reason=reason)


def cuda_name(name: str) -> bool:
    """Whether ``name`` is CUDA's (a ``cuda:i`` generator, a ``cuda_*``/``gpu_*`` sample field, an
    ``rng.cuda`` manifest field) in a test process that has initialised CUDA (tests/cuda does, on a GPU
    machine): tests of the CPU's names leave those aside there, and see every name elsewhere."""
    return torch.cuda.is_initialized() and name.startswith(("cuda", "gpu_", "rng.cuda"))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (so NaNs and -0.0 compare bit for bit)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_tensor_exact(a: torch.Tensor, b: torch.Tensor, where: str = "") -> None:
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    assert a.requires_grad == b.requires_grad, f"{where}: requires_grad differs"
    assert torch.equal(raw_bytes(a), raw_bytes(b)), f"{where}: bytes differ"


def assert_same(expected: Any, actual: Any, where: str = "state") -> None:
    """Type-exact, bit-exact structural equality (dict order, key types, tensor bytes)."""
    assert type(expected) is type(actual), f"{where}: {type(expected).__name__} became {type(actual).__name__}"
    if isinstance(expected, torch.Tensor):
        assert_tensor_exact(expected, actual, where)
    elif isinstance(expected, np.ndarray):
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, where
        assert np.ascontiguousarray(expected).tobytes() == actual.tobytes(), where
    elif isinstance(expected, np.generic):
        assert expected.dtype == actual.dtype and expected.tobytes() == actual.tobytes(), where
    elif isinstance(expected, dict):  # dict and OrderedDict: same keys, same order, same key types
        assert [(type(k), k) for k in expected] == [(type(k), k) for k in actual], f"{where}: keys differ"
        for key in expected:
            assert_same(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), f"{where}: length differs"
        for i, (x, y) in enumerate(zip(expected, actual)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert struct.pack("<d", expected) == struct.pack("<d", actual), f"{where}: {expected!r} != {actual!r}"
    elif isinstance(expected, complex):
        assert_same(expected.real, actual.real, where)
        assert_same(expected.imag, actual.imag, where)
    else:
        assert expected == actual, f"{where}: {expected!r} != {actual!r}"


def whole(value: Any) -> torch.Tensor:
    """A tensor as is, or a ckptfmt.Sharded assembled into a new tensor (what ckptfmt.load returns)."""
    if isinstance(value, torch.Tensor):
        return value
    out = torch.empty(value.shape, dtype=value.shards[0].tensor.dtype)
    for shard in value.shards:
        out[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.tensor.shape))] = shard.tensor
    return out


def assert_bits(a: Any, b: Any, where: str = "") -> None:
    """Bit-identical tensors of one dtype and shape, either given as a ckptfmt.Sharded (assembled first)."""
    a, b = whole(a), whole(b)
    assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype} {list(a.shape)} != {b.dtype} {list(b.shape)}"
    assert torch.equal(raw_bytes(a), raw_bytes(b)), f"{where}: bytes differ"


def torchrun(script: str, ranks: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run tests/scripts/``script`` on ``ranks`` CPU ranks under torchrun (a free port, one thread each);
    its output is returned, a non-zero exit code fails the test with it."""
    markers.require("distributed")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
         str(SCRIPTS / script), *args],
        env=script_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, \
        f"{script}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert_groups_released(script, result.stderr)
    return result


def assert_groups_released(script: str, stderr: str) -> None:
    """Fail when a rank of a launched program reported gloo threads alive at exit
    (tests/support/exit_check.py: the rare abort at exit, made certain)."""
    reports = [line for line in stderr.splitlines() if exit_check.MARKER in line]
    assert not reports, f"{script}: " + "; ".join(reports)


def script_env() -> dict[str, str]:
    """The environment of a launched test program: one thread per process, and the repository root
    first on PYTHONPATH, so that it imports tests.support."""
    pythonpath = os.environ.get("PYTHONPATH")
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(SCRIPTS.parents[1]), *([pythonpath] if pythonpath else [])]))


def deepspeed_torchrun(script: str, ranks: int, *args: str, timeout: int = 900) -> None:
    """Run tests/scripts/``script`` on ``ranks`` CPU ranks under torchrun (DeepSpeed on CPU, gloo);
    fail with its output."""
    markers.require("deepspeed")
    markers.require("distributed")
    env = dict(script_env(), DS_ACCELERATOR="cpu", DS_BUILD_OPS="0")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
         str(SCRIPTS / script), *args],
        check=False, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert_groups_released(script, result.stderr)


def chunk_keys(repo_url: str, storage_options: dict | None = None) -> set[str]:
    """Every chunk object's key in a repository, on any backend."""
    storage = open_storage(repo_url, storage_options)
    keys = set()
    for prefix in storage.list(layout.CHUNKS_DIR):
        for name in storage.list(f"{layout.CHUNKS_DIR}/{prefix}"):
            if not name.startswith("."):  # temp files of interrupted local writes
                keys.add(f"{layout.CHUNKS_DIR}/{prefix}/{name}")
    return keys


def tensor_chunk_keys(reader, key: str) -> set[str]:
    """The chunk keys one tensor of an open checkpoint reads."""
    entry = reader.tensor_info(key)
    chunks = reader.manifest.chunks
    return {
        layout.chunk_key(chunks[p.chunk].hash, chunks[p.chunk].codec)
        for shard in entry.shards
        for p in shard.pieces
    }


def run_in_threads(target, count: int) -> None:
    """Run ``target(i)`` for i in range(count) on as many threads at once, and wait for all."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def rewrite_manifest(storage, name: str, change, patch=None, *, rows: bool = True) -> None:
    """Apply ``change`` to checkpoint ``name``'s manifest document (and ``patch`` to its encoded bytes,
    for what msgpack's packer refuses to write) and commit the result. With ``rows``, ``change`` sees the
    tensor and chunk tables as one map per entry (spec 6.4 and 6.3, valid in every version), not in columns
    (6.12, 6.13)."""
    commit = json.loads(storage.read(layout.commit_key(name), max_size=ANY_SIZE))
    doc = msgpack.unpackb(storage.read(layout.manifest_key(name, commit["manifest"]), max_size=ANY_SIZE), raw=False,
                          strict_map_key=False)
    if rows:
        doc["tensors"], doc["chunks"] = tensor_rows(doc["tensors"]), chunk_rows(doc["chunks"])
    change(doc)
    data = msgpack.packb(doc, use_bin_type=True)
    if patch is not None:
        data = patch(data)
    digest = chunk_hash(data)
    storage.write(layout.manifest_key(name, digest), data)
    storage.write(layout.commit_key(name), json.dumps({**commit, "manifest": digest,
                                                       "manifest_size": len(data)}).encode())


def within(seconds: float, call):
    """Run ``call`` on a thread and return its result or raise its exception; fail if it hangs."""
    outcome = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the test thread below
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s (hung)"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def make_root(kind: str, request, tmp_path) -> str:
    """A fresh, empty folder URL on backend ``kind``."""
    if kind == "local":
        return str(tmp_path / "store")
    if kind == "memory":
        return request.getfixturevalue("memory_root")
    if kind == "s3":
        return request.getfixturevalue("s3_bucket") + "/store"
    raise AssertionError(kind)


def sync_cli(*argv: str) -> tuple[int, str, str]:
    """Run ``ckptfmt sync`` the way the CLI does (a parser with its command registered): exit code, output,
    errors."""
    import argparse
    import io

    from rich.console import Console

    from ckptfmt.cli import _run
    from ckptfmt.cli.sync import register

    parser = argparse.ArgumentParser(prog="ckptfmt")
    parser.add_argument("--debug", action="store_true")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sync", *argv])
    out, err = Console(file=io.StringIO(), width=200), Console(file=io.StringIO(), width=200)
    code = _run(args, out, err)
    return code, out.file.getvalue(), err.file.getvalue()
