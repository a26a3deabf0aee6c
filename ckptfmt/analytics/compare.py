"""Compare two runs: are they identical, where do they first diverge, and what recorded difference explains it.

Checkpoints are aligned by step. Within a pair, tensors are compared in state
order: equal chunk hashes mean equal bytes, so bytes are read only for a tensor
whose hashes differ (its layout may differ with equal values: another world
size cuts it into other shards), and only until the first divergence is found.
Then every recorded difference that could explain it is listed by kind: the
data order (the first step, per rank, whose batch digests differ), seeds and
RNG states, topology, versions, determinism settings, code, hardware, and
hyperparameters (the user metadata).
"""

from __future__ import annotations

import os
from typing import Any

import blake3
import torch

from ..manifest import Manifest
from ..reader import CheckpointReader
from ..repository import CommitRecord, Repository
from ..step_timer import decode_steps
from ..values import decode_tree
from .tables import _flatten

#: Environment fields by kind of difference (dotted prefixes of spec 9.2's record).
_ENVIRONMENT_KINDS = (
    ("versions", ("python.", "torch.version", "torch.git_version", "torch.cuda", "torch.hip", "torch.cudnn",
                  "torch.nccl", "packages.")),
    ("determinism", ("determinism.",)),
    ("code", ("git.",)),
    ("hardware", ("cpu.", "gpus.", "torch.cuda_available", "os.", "hostname")),
)


def compare(a: str | os.PathLike, b: str | os.PathLike, *, atol: float = 0.0, rtol: float = 0.0,
            storage_options: dict | None = None) -> dict:
    """Compare runs ``a`` and ``b`` (repository URLs); see the module docstring.

    Returns ``{"identical", "first_divergence", "differences", "checkpoints", "steps_only_in_a",
    "steps_only_in_b"}``: ``identical`` is bit for bit (or within ``atol``/``rtol``, as
    ``torch.allclose``) at every common step, with the same steps saved; ``first_divergence`` is
    ``{"step", "checkpoint", "tensor", "max_abs", "max_rel", "reason"}`` or None; ``checkpoints`` lists
    per common step how many tensors' chunk hashes differ and whether the plain values are equal.
    """
    runs = [Repository.open(url, storage_options) for url in (a, b)]
    by_step = [_by_step(repo) for repo in runs]
    common = sorted(set(by_step[0]) & set(by_step[1]))
    checkpoints, divergence = [], None
    for step in common:
        records = [steps[step] for steps in by_step]
        manifests = [repo.manifest(r.name, r) for repo, r in zip(runs, records)]
        entry = {"step": step, "a": records[0].name, "b": records[1].name, **_same_state(manifests)}
        if divergence is None and entry["tensors_differing"]:  # the first pair that may differ: read to be sure
            found = _first_divergence(runs, records, manifests, atol, rtol)
            if found is not None:
                divergence = {"step": step, "checkpoint": records[0].name, **found}
        checkpoints.append(entry)
    differences = _differences(runs, by_step)
    only = [sorted(set(by_step[0]) - set(common)), sorted(set(by_step[1]) - set(common))]
    identical = bool(common) and divergence is None and all(c["values_equal"] for c in checkpoints) and not any(only)
    return {"identical": identical, "first_divergence": divergence, "differences": differences,
            "checkpoints": checkpoints, "steps_only_in_a": only[0], "steps_only_in_b": only[1]}


def _by_step(repo: Repository) -> dict[int, CommitRecord]:
    """The run's checkpoints by step (the newest of a step saved twice); checkpoints without a step are left out."""
    return {r.step: r for r in repo.commits() if r.step is not None}


# -- the states -------------------------------------------------------------------------------------
def _same_state(manifests: list[Manifest]) -> dict:
    """How many tensors' chunk hashes differ (in all, and per group: a key's first segment, ``model``,
    ``optim``), and whether the plain values are equal."""
    hashes = [{t.key: _layout(m, t) for t in m.tensors} for m in manifests]
    keys = [t.key for t in manifests[0].tensors] + [k for k in hashes[1] if k not in hashes[0]]
    differing = [key for key in keys if hashes[0].get(key) != hashes[1].get(key)]
    groups: dict[str, int] = {}
    for key in differing:
        group = key.split("/", 1)[0]
        groups[group] = groups.get(group, 0) + 1
    values = [decode_tree(m.state, lambda index: None) for m in manifests]
    return {"tensors_differing": len(differing), "groups_differing": groups, "values_equal": values[0] == values[1]}


def _layout(manifest: Manifest, tensor) -> tuple:
    """A tensor's dtype, shape and pieces as chunk hashes: equal layouts hold equal bytes."""
    chunks = manifest.chunks
    return (tensor.dtype, tensor.shape, tuple((s.offsets, s.shape, tuple((chunks[p.chunk].hash, p.offset, p.length)
                                                                         for p in s.pieces)) for s in tensor.shards))


def _first_divergence(runs: list[Repository], records: list[CommitRecord], manifests: list[Manifest],
                      atol: float, rtol: float) -> dict | None:
    """The first tensor in state order whose values differ (beyond tolerance), reading only those whose
    layouts differ; None when every such tensor is equal after all."""
    layouts = [{t.key: _layout(m, t) for t in m.tensors} for m in manifests]
    readers = [CheckpointReader.from_parts(repo, record.name) for repo, record in zip(runs, records)]
    try:
        for tensor in manifests[0].tensors:
            key = tensor.key
            if layouts[0][key] == layouts[1].get(key):
                continue
            if key not in layouts[1]:
                return {"tensor": key, "max_abs": None, "max_rel": None, "reason": "only in a"}
            x, y = (reader.get_tensor(key) for reader in readers)
            if x.shape != y.shape or x.dtype != y.dtype:
                return {"tensor": key, "max_abs": None, "max_rel": None,
                        "reason": f"{x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}"}
            if torch.equal(x, y) or (x.is_floating_point() and torch.allclose(x, y, rtol=rtol, atol=atol,
                                                                                 equal_nan=True)):
                continue
            return {"tensor": key, **_difference(x, y), "reason": "values"}
        extra = [t.key for t in manifests[1].tensors if t.key not in layouts[0]]
        if extra:
            return {"tensor": extra[0], "max_abs": None, "max_rel": None, "reason": "only in b"}
        return None
    finally:
        for reader in readers:
            reader.close()


def _difference(x: torch.Tensor, y: torch.Tensor) -> dict:
    x64, y64 = x.double(), y.double()
    delta = (x64 - y64).abs()
    scale = torch.maximum(x64.abs(), y64.abs())
    relative = torch.where(scale > 0, delta / scale, torch.zeros_like(delta))
    return {"max_abs": float(delta.max()) if delta.numel() else 0.0,
            "max_rel": float(relative.max()) if relative.numel() else 0.0}


# -- what could explain it -----------------------------------------------------------------------------
def _differences(runs: list[Repository], by_step: list[dict[int, CommitRecord]]) -> list[dict]:
    """Every recorded difference between the runs, each with its kind."""
    if not by_step[0] or not by_step[1]:
        return []
    first = [repo.manifest(steps[min(steps)].name, steps[min(steps)]) for repo, steps in zip(runs, by_step)]
    found = _data_order(runs, by_step)
    found += _seeds(first)
    found += _topology(first)
    found += _environment(first)
    found += _hyperparameters(first)
    return found


def _data_order(runs: list[Repository], by_step: list[dict[int, CommitRecord]]) -> list[dict]:
    """Per rank, the first step whose batch digests differ (steps both runs recorded)."""
    digests = [_batches(repo, steps) for repo, steps in zip(runs, by_step)]
    found = []
    for rank in sorted(set(digests[0]) & set(digests[1])):
        a, b = digests[0][rank], digests[1][rank]
        differing = [step for step in sorted(set(a) & set(b)) if a[step] != b[step]]
        if differing:
            step = differing[0]
            found.append({"kind": "data_order", "field": "batch", "rank": rank, "a": _hex(a[step]),
                          "b": _hex(b[step]), "first_step": step})
    return found


def _batches(repo: Repository, steps: dict[int, CommitRecord]) -> dict[int, dict[int, bytes | None]]:
    """rank -> step -> batch digest (None where none was recorded)."""
    found: dict[int, dict[int, bytes | None]] = {}
    for record in steps.values():
        manifest = repo.manifest(record.name, record, skip=frozenset({"rng"}))
        for index, rank_record in enumerate(manifest.timing.get("ranks") or []):
            if not isinstance(rank_record, dict) or rank_record.get("steps") is None:
                continue
            columns = decode_steps(rank_record["steps"], f"{repo.storage.describe(record.name)}: "
                                                         f"timing.ranks[{index}].steps")
            digests = found.setdefault(rank_record.get("rank"), {})
            for step, digest, size in zip(columns.step.tolist(), columns.batch, columns.batch_size.tolist()):
                digests[step] = digest.tobytes() if size >= 0 else None
    return found


def _seeds(first: list[Manifest]) -> list[dict]:
    """Initial seeds and RNG states at each run's first checkpoint, per rank."""
    entries = [{e.get("rank", 0): e for e in m.rng if isinstance(e, dict)} for m in first]
    found = []
    for rank in sorted(set(entries[0]) & set(entries[1]), key=str):
        a, b = entries[0][rank], entries[1][rank]
        for field in ("torch_initial_seed", "torch_cpu", "cuda", "numpy", "python"):
            if a.get(field) != b.get(field):
                found.append({"kind": "seed", "field": f"rng.{field}", "rank": rank, "a": _short(a.get(field)),
                              "b": _short(b.get(field)), "first_step": first[0].step})
    return found


def _topology(first: list[Manifest]) -> list[dict]:
    topologies = [m.topology for m in first]
    found = []
    for field in ("world_size", "backend", "parallelism", "meshes"):
        a, b = (t.get(field) for t in topologies)
        if a != b:
            found.append({"kind": "topology", "field": field, "a": a, "b": b, "first_step": first[0].step})
    hosts = [sorted({str(r.get("host")) for r in t.get("ranks") or [] if isinstance(r, dict)}) for t in topologies]
    if hosts[0] != hosts[1]:
        found.append({"kind": "topology", "field": "hosts", "a": hosts[0], "b": hosts[1], "first_step": first[0].step})
    return found


def _environment(first: list[Manifest]) -> list[dict]:
    flat = [dict(_flatten({k: v for k, v in m.environment.items() if k not in ("ranks", "others")}))
            for m in first]
    found = []
    for field in sorted(set(flat[0]) | set(flat[1])):
        a, b = flat[0].get(field), flat[1].get(field)
        if a == b:
            continue
        kind = next((kind for kind, prefixes in _ENVIRONMENT_KINDS if field.startswith(prefixes)), "environment")
        found.append({"kind": kind, "field": field, "a": a, "b": b, "first_step": first[0].step})
    return found


def _hyperparameters(first: list[Manifest]) -> list[dict]:
    users = [dict(_flatten(decode_tree(m.user) if m.user else {})) for m in first]
    return [{"kind": "hyperparameters", "field": field, "a": users[0].get(field), "b": users[1].get(field),
             "first_step": first[0].step}
            for field in sorted(set(users[0]) | set(users[1])) if users[0].get(field) != users[1].get(field)]


def _hex(digest: bytes | None) -> str | None:
    return None if digest is None else digest.hex()


def _short(value: Any) -> Any:
    """A state as a short fingerprint (RNG states are kilobytes); small plain values as they are."""
    if isinstance(value, (int, float, str)) or value is None:
        return value
    return "blake3:" + blake3.blake3(repr(value).encode()).hexdigest()[:16]

