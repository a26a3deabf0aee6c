"""Compare two runs: are they identical, where do they first diverge, and what recorded difference explains it.

Checkpoints are aligned by step. Within a pair, tensors are compared in state
order: equal chunk hashes mean equal bytes, so bytes are read only for a tensor
whose hashes differ (its layout may differ with equal values: another world
size cuts it into other shards), and only until the first divergence is found.

Then every recorded difference is listed with its kind, whether it can explain
the divergence (``explains``) and why (``evidence``), the ones that can first:

- hyperparameters: the optimizers' ``param_groups`` and schedulers' states in
  the saved state, the user metadata's ``hparams`` map, and the user metadata
  that changes only where a run restarts (a setting changed at a resume);
- data_order: per rank, the first step whose batch digests differ;
- seed: seeds and generator states, compared at the first common step. A
  generator explains only if it was in use by the divergence: its state at the
  run's first checkpoint is not the one seeding leaves, or it advanced between
  checkpoints. Unseeded Python and NumPy generators differ between any two
  processes: never drawn from, they explain nothing ("differs, never used");
- values: the state's other plain values, and user metadata that changes
  between checkpoints one process saved. A value that changes so (a counter,
  a clock, a metric) records the run, it does not set it;
- code, topology, determinism, versions, hardware, environment: the records of
  the first common checkpoint (a machine's name changes no computation).

A difference explains only if it is present at or before the first diverging
checkpoint: one that appears later cannot have caused it.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

import blake3
import torch

from ckptfmt.analytics.tables import SKIPPED_FIELDS, flatten_fields
from ckptfmt.errors import quoted
from ckptfmt.format.history import History
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.plain_values import plain_leaves, plain_values
from ckptfmt.format.rng_states import python_words
from ckptfmt.format.values import decode_tree
from ckptfmt.loading.reader import CheckpointReader
from ckptfmt.metadata.step_timer import decode_steps
from ckptfmt.repository.history import read_histories, removed_histories
from ckptfmt.repository.repository import CommitRecord, Repository
from ckptfmt.tools.diff import same_value, value_difference

#: Environment fields by kind of difference (dotted prefixes of spec 9.2's record).
_ENVIRONMENT_KINDS = (
    ("versions", ("python.", "torch.version", "torch.git_version", "torch.cuda", "torch.hip", "torch.cudnn",
                  "torch.nccl", "packages.")),
    ("determinism", ("determinism.",)),
    ("code", ("git.",)),
    ("hardware", ("cpu.", "gpus.", "torch.cuda_available", "os.", "hostname")),
)

#: Kinds of difference that name a rank.
_RANKED_KINDS = ("data_order", "seed")
#: Kinds of difference, the strongest evidence first (the order of the list within each verdict).
_KINDS = ("hyperparameters", "data_order", "seed", "values", "code", "topology", "determinism", "versions",
          "hardware", "environment")

#: Records that name a machine: another name changes no computation.
_NAMES = ("hostname", "hosts")


@dataclass(frozen=True)
class Divergence:
    """The first tensor in state order whose values differ, at the first common step where one does."""

    step: int
    checkpoint: str  # run a's checkpoint of that step
    tensor: str
    #: The largest absolute and relative differences; None where the tensors cannot be compared value by
    #: value (``reason`` says why).
    max_abs: float | None
    max_rel: float | None
    reason: str  # "values", "only in a", "only in b", or the dtypes and shapes that differ


@dataclass(frozen=True)
class CommonCheckpoint:
    """The two runs' checkpoints of one step, as far as their manifests tell."""

    step: int
    a: str
    b: str
    tensors_differing: int  # tensors whose chunk hashes differ (equal hashes: equal bytes)
    groups_differing: dict[str, int]  # the same per tensor group (a key's first segment: model, optim)
    values_equal: bool  # the state's plain values


@dataclass(frozen=True)
class Difference:
    """A recorded difference between the runs, and whether it can explain the divergence."""

    kind: str  # one of _KINDS
    field: str
    a: Any  # each run's value; "<absent>" where a run lacks it
    b: Any
    first_step: int  # the step it is first seen at
    explains: bool
    evidence: str  # why it can explain the divergence, or cannot
    rank: Any = None  # the rank whose data order or generator differs (those kinds only)

    def to_json(self) -> dict:
        ranked = {"rank": self.rank} if self.kind in _RANKED_KINDS else {}
        return {"kind": self.kind, "field": self.field, **ranked, "a": self.a, "b": self.b,
                "first_step": self.first_step, "explains": self.explains, "evidence": self.evidence}


@dataclass(frozen=True)
class Comparison:
    """What ``compare`` found: the verdict, where the runs first diverge and what may explain it."""

    a: str  # the runs' repository URLs
    b: str
    #: Bit for bit (or within atol/rtol) at every common step, with the same steps saved.
    identical: bool
    first_divergence: Divergence | None
    #: Those that can explain the divergence first, each part ordered by kind as in the module docstring.
    differences: list[Difference]
    checkpoints: list[CommonCheckpoint]  # one per common step, in step order
    steps_only_in_a: list[int]
    steps_only_in_b: list[int]

    def to_json(self) -> dict:
        return {"a": self.a, "b": self.b, "identical": self.identical,
                "first_divergence": None if self.first_divergence is None else asdict(self.first_divergence),
                "differences": [d.to_json() for d in self.differences],
                "checkpoints": [asdict(c) for c in self.checkpoints],
                "steps_only_in_a": self.steps_only_in_a, "steps_only_in_b": self.steps_only_in_b}


def compare(a: str | os.PathLike, b: str | os.PathLike, *, atol: float = 0.0, rtol: float = 0.0,
            storage_options: dict | None = None) -> Comparison:
    """Compare runs ``a`` and ``b`` (repository URLs); see the module docstring. ``identical`` is bit for
    bit, or within ``atol``/``rtol`` as ``torch.allclose``. Each checkpoint's manifest is read once."""
    runs = [_Run(url, storage_options) for url in (a, b)]
    common = sorted(set(runs[0].by_step) & set(runs[1].by_step))
    # Like is compared with like: the records of the first common step, or of each run's first without one.
    first_steps = [common[0] if common else min(run.by_step, default=None) for run in runs]
    first: list[Manifest | None] = [None, None]
    checkpoints: list[CommonCheckpoint] = []
    divergence: Divergence | None = None
    recorded: dict[int, list[dict]] = {}
    for step in sorted(set(runs[0].by_step) | set(runs[1].by_step)):
        pending = divergence is None and step in common  # this pair may diverge: its RNG records are wanted
        manifests = [run.read(step, rng=pending) if step in run.by_step else None for run in runs]
        for index, manifest in enumerate(manifests):
            if step == first_steps[index]:
                first[index] = manifest
        if manifests[0] is None or manifests[1] is None:
            continue
        pair = [manifests[0], manifests[1]]
        records = [run.by_step[step] for run in runs]
        recorded[step] = [_recorded_values(m) for m in pair]
        counts = _tensors_differing(pair)
        checkpoints.append(CommonCheckpoint(step, records[0].name, records[1].name, **counts, values_equal=not (
            value_difference(recorded[step][0]["state"], recorded[step][1]["state"]))))
        if divergence is None and counts["tensors_differing"]:  # the first pair that may differ: read to be sure
            found = _first_divergence(runs, records, pair, atol, rtol)
            if found is not None:
                divergence = Divergence(step, records[0].name, **found)
                for run, manifest in zip(runs, pair):
                    run.rng[step] = _rng_by_rank(manifest)  # the seeds' verdict looks at the divergence too
    diverged_at = None if divergence is None else divergence.step
    first_a, first_b = first
    differences = [] if first_a is None or first_b is None else _differences(runs, [first_a, first_b], recorded,
                                                                               diverged_at)
    only = [sorted(set(run.by_step) - set(common)) for run in runs]
    identical = bool(common) and divergence is None and all(c.values_equal for c in checkpoints) and not any(only)
    return Comparison(runs[0].repo.url, runs[1].repo.url, identical, divergence, differences, checkpoints,
                      only[0], only[1])


class _Run:
    """One run: its checkpoints by step (the newest of a step saved twice; those without a step are left
    out), and what the comparison keeps of each manifest once it is read: batch digests, and the RNG
    records of the checkpoints the seeds' verdict looks at (the first, the last, the divergence's)."""

    def __init__(self, url: str | os.PathLike, storage_options: dict | None):
        self.repo = Repository.open(url, storage_options)
        records = self.repo.commits()
        self.by_step = {r.step: r for r in records if r.step is not None}
        self.ends = {min(self.by_step), max(self.by_step)} if self.by_step else set()
        self.batches: dict[Any, dict[int, bytes | None]] = {}  # rank (as recorded) -> step -> digest or None
        #: When the checkpoint a step's digest came from was saved: a step recorded twice (computed again
        #: after a resume) keeps the later save's, the branch the run went on with.
        self._batch_saved: dict[tuple[Any, int], int] = {}
        self.rng: dict[int, dict[Any, dict]] = {}  # step -> rank -> RNG record
        for history in read_histories(self.repo, removed_histories(self.repo, records)):  # spec 4.5
            self._keep_batches(history, history)

    def read(self, step: int, *, rng: bool) -> Manifest:
        """The manifest of ``step``, its batch digests and (at the first and last step) RNG records kept;
        ``rng``: parse its RNG records anyway (most of a many-rank manifest's parse time)."""
        record = self.by_step[step]
        ends = step in self.ends
        manifest = self.repo.manifest(record.name, record, skip=frozenset() if rng or ends else SKIPPED_FIELDS)
        self._keep_batches(record, manifest)
        if ends:
            self.rng[step] = _rng_by_rank(manifest)
        return manifest

    def _keep_batches(self, record: CommitRecord | History, manifest: Manifest | History) -> None:
        for index, rank_record in enumerate(manifest.timing.get("ranks") or []):
            if not isinstance(rank_record, dict) or rank_record.get("steps") is None:
                continue
            columns = decode_steps(rank_record["steps"], f"{self.repo.storage.describe(record.name)}: "
                                                         f"timing.ranks[{index}].steps")
            rank = rank_record.get("rank")
            digests = self.batches.setdefault(rank, {})
            for step, digest, size in zip(columns.step.tolist(), columns.batch, columns.batch_size.tolist()):
                if self._batch_saved.setdefault((rank, step), record.created_ns) <= record.created_ns:
                    self._batch_saved[rank, step] = record.created_ns
                    digests[step] = digest.tobytes() if size >= 0 else None


# -- the states -------------------------------------------------------------------------------------
def _tensors_differing(manifests: list[Manifest]) -> dict:
    """How many tensors' chunk hashes differ, in all and per group (a key's first segment: ``model``,
    ``optim``)."""
    hashes = [{t.key: _layout(m, t) for t in m.tensors} for m in manifests]
    keys = [t.key for t in manifests[0].tensors] + [k for k in hashes[1] if k not in hashes[0]]
    differing = [key for key in keys if hashes[0].get(key) != hashes[1].get(key)]
    groups: dict[str, int] = {}
    for key in differing:
        group = key.split("/", 1)[0]
        groups[group] = groups.get(group, 0) + 1
    return {"tensors_differing": len(differing), "groups_differing": groups}


def _recorded_values(manifest: Manifest) -> dict[str, Any]:
    """A checkpoint's plain values: its state's by key, its user metadata's by dotted field (``user.lr``),
    and the processes that saved it (``_processes``)."""
    user = decode_tree(manifest.user) if manifest.user else {}
    return {"state": plain_values(manifest),
            "user": {".".join(map(str, ("user", *path))): value for path, value in plain_leaves(user)} if user else {},
            "processes": _processes(manifest)}


def _processes(manifest: Manifest) -> tuple[frozenset, bool]:
    """Who saved the checkpoint, as the (host, pid) of each rank (spec 9.3), and whether one of them had
    resumed since its last save (a ``resumes`` record, spec 9.4): a run's settings may change between two
    of its checkpoints across a restart or a resume, not between two saves of the same processes."""
    ranks = manifest.topology.get("ranks") if isinstance(manifest.topology, dict) else None
    saved_by = frozenset((str(entry.get("host")), str(entry.get("pid"))) for entry in ranks or []
                         if isinstance(entry, dict))
    timing = manifest.timing.get("ranks") if isinstance(manifest.timing, dict) else None
    return saved_by, any(isinstance(entry, dict) and entry.get("resumes") for entry in timing or [])


def _layout(manifest: Manifest, tensor) -> tuple:
    """A tensor's dtype, shape and pieces as chunk hashes: equal layouts hold equal bytes."""
    chunks = manifest.chunks
    return (tensor.dtype, tensor.shape, tuple((s.offsets, s.shape, tuple((chunks[p.chunk].hash, p.offset, p.length)
                                                                         for p in s.pieces)) for s in tensor.shards))


def _first_divergence(runs: list[_Run], records: list[CommitRecord], manifests: list[Manifest],
                      atol: float, rtol: float) -> dict | None:
    """The first tensor in state order whose values differ (beyond tolerance), reading only those whose
    layouts differ; None when every such tensor is equal after all."""
    layouts = [{t.key: _layout(m, t) for t in m.tensors} for m in manifests]
    readers = [CheckpointReader.from_parts(run.repo, record.name, read=(record, manifest))
               for run, record, manifest in zip(runs, records, manifests)]
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
def _differences(runs: list[_Run], first: list[Manifest], recorded: dict[int, list[dict]],
                 diverged_at: int | None) -> list[Difference]:
    """Every recorded difference between the runs with its kind and verdict, those that can explain the
    divergence first, then by kind (strongest evidence first), then by the step they appear. ``first``:
    each run's manifest at the first common step (at its first step where there is none)."""
    found = _data_order(runs, diverged_at)
    found += _seeds(runs, first, diverged_at)
    found += _topology(first, diverged_at)
    found += _environment(first, diverged_at)
    found += _plain_differences(recorded, diverged_at)
    return sorted(found, key=lambda d: (not d.explains, _KINDS.index(d.kind), d.first_step))


def _difference_entry(kind: str, field: str, a: Any, b: Any, first_step: int, diverged_at: int | None,
                      what: str = "differs from", rank: Any = None) -> Difference:
    """A difference whose verdict follows from when it appears: at or before the divergence it can explain it."""
    explains, evidence = _when(first_step, diverged_at, what)
    return Difference(kind, field, a, b, first_step, explains, evidence, rank)


def _when(first_step: int, diverged_at: int | None, what: str) -> tuple[bool, str]:
    if diverged_at is None:
        return False, "no common checkpoint diverges"
    if first_step < diverged_at:
        return True, f"{what} step {first_step}, before the divergence at step {diverged_at}"
    if first_step == diverged_at:
        return True, f"{what} step {first_step}, where the states diverge"
    return False, f"{what} step {first_step}, after the divergence at step {diverged_at}: it cannot explain it"


def _data_order(runs: list[_Run], diverged_at: int | None) -> list[Difference]:
    """Per rank, the first step whose batch digests differ (steps both runs recorded)."""
    found = []
    for rank in sorted(set(runs[0].batches) & set(runs[1].batches), key=_rank_order):
        a, b = runs[0].batches[rank], runs[1].batches[rank]
        differing = [step for step in sorted(set(a) & set(b)) if a[step] != b[step]]
        if differing:
            step = differing[0]
            found.append(_difference_entry("data_order", "batch", _hex(a[step]), _hex(b[step]), step, diverged_at,
                                           "batches differ from", rank=rank))
    return found


# -- seeds and generators ------------------------------------------------------------------------------
#: Fields of a rank's RNG record, and the generator each belongs to.
_GENERATORS = {"torch_initial_seed": "torch_cpu", "torch_cpu": "torch_cpu", "cuda": "cuda", "numpy": "numpy",
               "python": "python"}


def _seeds(runs: list[_Run], first: list[Manifest], diverged_at: int | None) -> list[Difference]:
    """Seeds and generator states that differ at the first common checkpoint, per rank, each judged by
    whether its generator was drawn from by the divergence."""
    entries = [_rng_by_rank(m) for m in first]
    differing = [(rank, field) for rank in sorted(set(entries[0]) & set(entries[1]), key=_rank_order)
                 for field in _GENERATORS if entries[0][rank].get(field) != entries[1][rank].get(field)]
    if not differing:
        return []
    # A generator drawn from between two checkpoints never returns to the state it had (the periods are
    # astronomic): each run's RNG records at its first checkpoint, at the divergence and at its last.
    histories = [sorted(run.rng.items()) for run in runs]
    found = []
    for rank, field in differing:
        draws = [_first_draw(history, rank, _GENERATORS[field]) for history in histories]
        explains, evidence = _generator_verdict(draws, diverged_at)
        found.append(Difference("seed", f"rng.{field}", _short(entries[0][rank].get(field)),
                                _short(entries[1][rank].get(field)), _common_step(first), explains, evidence, rank))
    return found


def _rank_order(rank: Any) -> tuple[int, int | str]:
    """Ranks in numeric order, any other recorded value after them."""
    return (0, rank) if type(rank) is int else (1, str(rank))


def _rng_by_rank(manifest: Manifest) -> dict[Any, dict]:
    return {e.get("rank", 0): e for e in manifest.rng if isinstance(e, dict) and type(e.get("rank", 0)) is int}


def _first_draw(history: list[tuple[int, dict[Any, dict]]], rank: Any, generator: str) -> tuple[int, str] | None:
    """(the first checkpoint step by which ``rank``'s generator was seen drawn from, how), or None if never."""
    records = [(step, entries[rank]) for step, entries in history if rank in entries]
    if not records:
        return None
    if not _freshly_seeded(generator, records[0][1]):
        return records[0][0], f"drawn from before step {records[0][0]}"
    for (previous, record), (step, later) in zip(records, records[1:]):
        if later.get(generator) != record.get(generator):
            return step, f"advanced between steps {previous} and {step}"
    return None


def _generator_verdict(draws: list[tuple[int, str] | None], diverged_at: int | None) -> tuple[bool, str]:
    """Whether a differing seed or state can explain the divergence: only if its generator was in use by then."""
    used = [(draw[0], f"{draw[1]} in run {run}") for run, draw in zip("ab", draws) if draw is not None]
    if not used:
        return False, "differs, never used: in both runs every checkpoint holds the state seeding left"
    step, how = min(used)
    if diverged_at is None:
        return False, f"no common checkpoint diverges (in use: {how})"
    if step <= diverged_at:
        return True, f"in use: {how}"
    return False, f"first drawn from after the divergence at step {diverged_at} ({how})"


def _freshly_seeded(generator: str, entry: dict) -> bool:
    """Whether a generator holds the state seeding left (never drawn from since); False when unsure.

    Exact for torch's CPU generator (the state ``manual_seed(initial seed)`` gives) and CUDA's (Philox
    offset 0). Python's and NumPy's Mersenne Twisters: a key as seeding builds it (``init_genrand``, or
    starting 0x80000000 as ``init_by_array`` and entropy seeding do; the first draw past the block
    replaces it) at the position seeding sets: 624, or 623 where NumPy seeds a new process from entropy.
    NumPy's ``seed()`` without a seed keeps the position it had, so a generator reseeded that way after
    use counts as used.
    """
    state: Any = entry.get(generator)
    try:
        if generator == "torch_cpu":
            seed = entry.get("torch_initial_seed")
            return type(seed) is int and state == _torch_seeded_state(seed)
        if generator == "cuda":
            return all(type(s) is bytes and len(s) == 16 and s[8:] == bytes(8) for s in state)
        if generator == "numpy":
            keys, pos = state["keys"], state["pos"]
            block_start = keys[:4] == (0x80000000).to_bytes(4, "little")
            return state["has_gauss"] == 0 and ((pos == 623 and block_start) or
                                                 (pos == 624 and (block_start or _init_genrand_key(keys))))
        if generator == "python":
            words = python_words(state["state"])
            return words[-1] == 624 and words[0] == 0x80000000 and state["gauss_next"] is None
    except (KeyError, TypeError, IndexError, ValueError, RuntimeError, OverflowError):
        pass
    return False


@functools.lru_cache(maxsize=64)
def _torch_seeded_state(seed: int) -> bytes:
    return torch.Generator().manual_seed(seed).get_state().numpy().tobytes()


def _init_genrand_key(keys: bytes) -> bool:
    """Whether a Mersenne Twister key starts as ``init_genrand`` (NumPy's ``seed(int)``) builds it."""
    words = [int.from_bytes(keys[i:i + 4], "little") for i in range(0, 16, 4)]
    return len(keys) >= 16 and all(
        words[i] == (1812433253 * (words[i - 1] ^ (words[i - 1] >> 30)) + i) & 0xFFFFFFFF for i in (1, 2, 3))


# -- records of the first common checkpoint -------------------------------------------------------------
def _common_step(first: list[Manifest]) -> int:
    """The step of the first common checkpoint: the runs are aligned by step, so it has one."""
    step = first[0].step
    assert step is not None
    return step


def _topology(first: list[Manifest], diverged_at: int | None) -> list[Difference]:
    topologies = [m.topology for m in first]
    found = []
    for field in ("world_size", "backend", "parallelism", "meshes"):
        a, b = (t.get(field) for t in topologies)
        if a != b:
            found.append(_recorded_entry("topology", field, a, b, _common_step(first), diverged_at))
    hosts = [sorted({str(r.get("host")) for r in t.get("ranks") or [] if isinstance(r, dict)}) for t in topologies]
    if hosts[0] != hosts[1]:
        found.append(_recorded_entry("topology", "hosts", hosts[0], hosts[1], _common_step(first), diverged_at))
    return found


def _environment(first: list[Manifest], diverged_at: int | None) -> list[Difference]:
    flat = [dict(flatten_fields({k: v for k, v in m.environment.items() if k not in ("ranks", "others")}))
            for m in first]
    found = []
    for field in sorted(set(flat[0]) | set(flat[1])):
        a, b = flat[0].get(field), flat[1].get(field)
        if a == b:
            continue
        kind = next((kind for kind, prefixes in _ENVIRONMENT_KINDS if field.startswith(prefixes)), "environment")
        found.append(_recorded_entry(kind, field, a, b, _common_step(first), diverged_at))
    return found


def _recorded_entry(kind: str, field: str, a: Any, b: Any, step: int, diverged_at: int | None) -> Difference:
    """A difference in what the first common checkpoint records about the run: present from the start."""
    entry = _difference_entry(kind, field, a, b, step, diverged_at, "recorded at")
    if field in _NAMES:
        entry = replace(entry, explains=False, evidence="a machine's name changes no computation")
    return entry


# -- plain values: hyperparameters and the rest -----------------------------------------------------------
#: The user metadata's map of the run's settings (``save(..., metadata={"hparams": {"lr": 0.1}})``): its values
#: are hyperparameters whenever they change, never a run's counters.
HPARAMS_KEY = "hparams"
#: Key segments under which a state's plain values are hyperparameters (torch optimizers, Lightning).
_HYPERPARAMETER_SEGMENTS = frozenset({"param_groups", "hparams", "hyper_parameters", "hyperparameters"})
#: Keys beside ``last_epoch`` that make a map a learning-rate scheduler's state (LRScheduler, ReduceLROnPlateau).
_SCHEDULER_KEYS = ("base_lrs", "_last_lr", "min_lrs")


def _plain_differences(recorded: dict[int, list[dict]], diverged_at: int | None) -> list[Difference]:
    """The state's plain values and the user metadata that differ at a common step, each at the first step
    it differs, classified and judged."""
    found = []
    for source in ("state", "user"):
        series = [(step, (pair[0][source], pair[1][source]), (pair[0]["processes"], pair[1]["processes"]))
                  for step, pair in sorted(recorded.items())]
        seen: set[str] = set()
        for step, (a, b), _ in series:
            new = [difference for difference in value_difference(a, b) if difference[0] not in seen]
            keys = a.keys() | b.keys() if new else set()
            for field, value_a, value_b in new:
                seen.add(field)
                hyperparameter = _is_hyperparameter(field, keys) if source == "state" else \
                    field.startswith(f"user.{HPARAMS_KEY}.")
                found.append(_plain_entry(source, field, value_a, value_b, step, hyperparameter, series, diverged_at))
    return found


def _plain_entry(source: str, field: str, a: Any, b: Any, step: int, hyperparameter: bool,
                 series: list[tuple[int, tuple[dict, dict], tuple]], diverged_at: int | None) -> Difference:
    """A differing plain value: a hyperparameter by where it sits (an optimizer's ``param_groups``, a
    scheduler's state, the metadata's ``hparams``), or metadata that changes only where a run restarts (a
    setting changed at a resume); any other value that changes between checkpoints one process saved
    records the run (a counter, a clock, a metric), it does not set it."""
    changing = None if hyperparameter else _change_along_a_run(field, series)
    kind = "hyperparameters" if hyperparameter or (source == "user" and changing is None) else "values"
    entry = _difference_entry(kind, field, _shown(a), _shown(b), step, diverged_at)
    if changing is not None:
        entry = replace(entry, explains=False, evidence=f"changes between {changing}: it records the run (a "
                                                        "counter, clock or metric), it does not set it")
    return entry


def _is_hyperparameter(key: str, keys: set[str]) -> bool:
    """Whether a state key is an optimizer's or scheduler's setting: under ``param_groups`` (or a
    hyperparameter map), or in a map that holds ``last_epoch`` beside a scheduler's learning rates."""
    segments = key.split("/")
    if _HYPERPARAMETER_SEGMENTS.intersection(segments):
        return True
    for depth in range(len(segments)):
        prefix = "".join(f"{segment}/" for segment in segments[:depth])
        if f"{prefix}last_epoch" in keys and any(f"{prefix}{other}" in keys for other in _SCHEDULER_KEYS):
            return True
    return False


def _change_along_a_run(field: str, series: list[tuple[int, tuple[dict, dict], tuple]]) -> str | None:
    """'steps X and Y of run a' for the first two common steps, saved by the same processes, between which
    ``field`` changes in one run, or None. A change between checkpoints of other processes (a restart:
    the run resumed between them) is a setting changed at the resume, not a counter's."""
    for run, name in enumerate("ab"):
        held = [(step, values[run][field], processes[run]) for step, values, processes in series
                if field in values[run]]
        for (step, value, (saved_by, _)), (later, next_value, (next_saved_by, resumed)) in zip(held, held[1:]):
            if not same_value(value, next_value) and saved_by == next_saved_by and not resumed:
                return f"steps {step} and {later} of run {name}"
    return None


def _shown(value: Any) -> Any:
    """A plain value as JSON holds it: numbers, strings, booleans, None and lists of them as they are; NaN and
    infinities as ``NaN``, ``Inf`` and ``-Inf`` (JSON has no such number); other types as their repr."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"nan": "NaN", "inf": "Inf", "-inf": "-Inf"}[repr(value)]
    if isinstance(value, (list, tuple)):
        return [_shown(item) for item in value]
    return quoted(value)  # ABSENT shows as <absent>


def _hex(digest: bytes | None) -> str | None:
    return None if digest is None else digest.hex()


def _short(value: Any) -> Any:
    """A state as a short fingerprint (RNG states are kilobytes); small plain values as they are."""
    if isinstance(value, (int, float, str)) or value is None:
        return value
    return "blake3:" + blake3.blake3(repr(value).encode()).hexdigest()[:16]
