"""``ckptfmt.save``: write a training state as a new checkpoint, durably and atomically.

The public keywords become one ``SaveOptions``; ``run_save`` runs the one save
pipeline (saving/pipeline.py) over the ranks saving together: the process group
under torch.distributed, else this process alone, a group of one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ckptfmt.errors import CollectiveError
from ckptfmt.groups.process_group import RankGroup, distributed_group
from ckptfmt.groups.ranks import Ranks, SoloRanks
from ckptfmt.metadata.resumes import forget_resumes, pending_resumes
from ckptfmt.metadata.step_timer import StepTimer
from ckptfmt.metadata.topology import current_rank
from ckptfmt.repository.progress import bind as bind_progress
from ckptfmt.saving import in_flight
from ckptfmt.saving.options import DEFAULT_TIMEOUT_S, LATEST, Group, SaveOptions
from ckptfmt.saving.pipeline import EVERY_RANK, save_over
from ckptfmt.saving.records import Captured
from ckptfmt.tensors.stateful import states_taken


def save(
    state: Any,
    url: str | os.PathLike,
    *,
    step: int | None = None,
    metadata: dict | None = None,
    storage_options: dict | None = None,
    parent: Any = LATEST,
    chunk_size: int | None = None,
    compression: str | None = None,
    step_times: list | None = None,
    parallelism: dict | None = None,
    workers: int | None = None,
    rng: list[dict] | None = None,
    provenance: dict | None = None,
    before_commit: Callable[[], None] | None = None,
    process_group: Any = None,
    coordinated: bool | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    tensor_stats: bool = True,
    on_divergence: str = "warn",
    gathered_steps: list | None = None,
    signer: Any = None,
    scope: str = "job",
    format_version: str | tuple[int, int] | None = None,
    parity: str | None = None,
    timer: StepTimer | None = None,
) -> str:
    """Save ``state`` (nested dicts/lists/tuples of tensors and plain values) as checkpoint ``url``.

    An object in it with ``state_dict()`` and ``load_state_dict()`` (a module, an optimizer, a
    scheduler, a GradScaler, a stateful data loader: DCP's ``Stateful``) is stored as its
    ``state_dict()`` taken now; ``load(url, into=...)`` loads it back into such objects in place.

    ``url`` is ``REPO/NAME``: the repository is created when missing and NAME
    must be new. Returns the checkpoint's URL. Durable when it returns.

    ``parent`` defaults to the repository's latest checkpoint (None for none);
    ``compression`` is None, 'zstd', 'shuffle-zstd', 'float-zstd' (floating-point
    tensors' sign and exponent apart from their mantissa; the rest as
    'shuffle-zstd'), 'delta-zstd' (each chunk
    stored as its XOR against the parent's chunk for the same tensor region,
    where that is smaller by 10%; the rest as 'shuffle-zstd') or 'auto' (per
    chunk, what stores it smallest, uncompressed unless compression saves 10%;
    floating-point tensors with the float codecs, whole or as deltas);
    deltas need a parent, and are taken on every rank of a collective save
    alike. ``step_times`` are the caller's per-step timings, stored under
    ``timing``; ``parallelism`` records the run's layout (e.g.
    ``{"dp": 8, "tp": 2}``). Converters pass ``rng`` (entries recorded by
    another tool, replacing this process's states) and ``provenance`` (where
    an imported checkpoint came from).

    ``before_commit`` is called once every chunk is durable, just before the
    manifest and commit record are written; if it raises, the save stops there
    and the exception propagates, leaving no checkpoint (only orphan chunks,
    spec 11.6). Converters use it to finish checking their source while the
    chunks are written, instead of before.

    Under torch.distributed (a default process group of more than one process,
    or ``process_group``) the save is collective, like
    ``torch.distributed.checkpoint.save``: every rank calls it with its own
    state and one checkpoint holds them all (replicated values stored once,
    DTensors as their shards, ``ckptfmt.PerRank`` values per rank). It fails
    on every rank, committing nothing, if any rank fails or does not answer
    within ``timeout`` seconds. ``coordinated=False`` saves this process's
    state alone, as a single-process save.

    ``tensor_stats``: each tensor's statistics (count, min, max, mean, norm,
    NaN, infinities, zeros; spec 6.10) are taken as its bytes are hashed and
    stored in the manifest, where ``ckptfmt show`` and the health analysis read
    them; False leaves them out.

    ``on_divergence``: a collective save compares every rank's copy of each
    replicated tensor (DDP's parameters, replicated DTensors), which must be
    identical; copies that differ (a rank's silent data corruption, or a run
    out of sync) are recorded in the manifest and warned of (``"warn"``), or
    fail the save on every rank with nothing committed (``"raise"``); the copy
    stored is the majority's. ``"ignore"`` compares nothing.

    ``timer`` (a ``ckptfmt.StepTimer``): its steps not yet in a checkpoint are
    stored with this one, every rank's (spec 9.4), and leave the timer once it
    is committed. ``gathered_steps``: every rank's steps, gathered for a save
    made by one rank (``ckptfmt.distributed.steps.gather_steps``; frameworks
    that write from rank 0 only), stored as each rank's.

    ``signer``: a private key, Ed25519, ML-DSA-65 or the hybrid of both (a PEM
    file: ``ckptfmt keygen``, a ``cryptography`` key, a ``ckptfmt.SigningKey``) that signs the checkpoint
    (spec 10.3) before it is committed: readers given its public key
    (``trusted_keys=``, ``verify --trusted-key``) then refuse any checkpoint it
    did not sign. The key never enters the repository. In a collective save
    the coordinator (rank 0) signs.

    ``scope="node"``: the repository's URL names each node's own storage (a
    node-local disk, the same path on every node). Each node's repository
    holds the boxes its ranks hold, and gets the checkpoint's manifest and
    commit record once rank 0 has committed on its own; the manifest records
    which node holds which chunks (spec 9.8).

    ``format_version="1.6"``: write for readers of that format version (spec
    13.3): its table forms, codecs and fields only (``compression="auto"``
    chooses among its codecs); an option it cannot express (``float-zstd``
    before 1.11, a signer before 1.7, ``scope="node"`` before 1.10) is a
    ValueError naming the version that first has it. A repository created by
    such a save is readable by that version's readers; one whose marker is
    already of a newer major stays so. None: this ckptfmt's own format.

    ``parity="8+2"``: protect the checkpoint with Reed-Solomon parity (spec
    5.6, format 2.1): its objects striped 8 at a time with 2 parity objects a
    stripe, so that any 2 lost or damaged objects of a stripe rebuild with
    ``ckptfmt repair`` and no replica (about M/K more bytes stored). Parity is
    written before the commit record, which names it.

    An asynchronous save of the same repository still running in this process
    is waited for first (its error, if it failed, is raised here).
    """
    options = SaveOptions(
        step=step, metadata=metadata, storage_options=storage_options, parent=parent, chunk_size=chunk_size,
        compression=compression, step_times=step_times, parallelism=parallelism, workers=workers, rng=rng,
        provenance=provenance, before_commit=before_commit, process_group=process_group, coordinated=coordinated,
        timeout=timeout, tensor_stats=tensor_stats, on_divergence=on_divergence, gathered_steps=gathered_steps,
        signer=signer, scope=scope, format_version=format_version, parity=parity,
    )
    return save_with(state, url, options, timer=timer)


def save_with(state: Any, url: str | os.PathLike, options: SaveOptions, *, timer: StepTimer | None = None) -> str:
    """``save`` with its options already made (a CheckpointManager's)."""
    began_ns = time.time_ns()
    in_flight.wait_for_previous(url)
    steps = step_records(timer)
    captured = Captured(steps=steps, resumes=pending_resumes())
    committed = run_save(states_taken(state), url, options, captured)
    if timer is not None:
        if steps is not None:
            timer.forget_stored(steps)
        bind_progress(timer, committed, options.storage_options, current_rank()[0])
        timer.held(began_ns, (time.time_ns() - began_ns) / 1e9)
    forget_resumes(captured.resumes)
    return committed


def run_save(state: Any, url: str | os.PathLike, options: SaveOptions, captured: Captured) -> str:
    """The save pipeline over the ranks saving together."""
    return save_over(state, url, saving_ranks(url, options.group), options, captured)


def saving_ranks(url: str | os.PathLike, options: Group) -> Ranks:
    """Who saves (``options``: a save's ``SaveOptions.group``): every rank of the process group under
    torch.distributed (unless ``coordinated=False``), else this process alone, recording its rank in the job."""
    group = None if options.alone else distributed_group(options.process_group)
    if group is None:
        if options.needs_group:
            raise ValueError("coordinated=True needs an initialised torch.distributed process group")
        return SoloRanks(*current_rank())
    if options.gathered_steps is not None:
        raise ValueError("gathered_steps is for a save made by one rank (coordinated=False): in a collective "
                         "save every rank records its own steps")
    try:
        return RankGroup(group, options.timeout, f"collective save of {os.fspath(url)}")
    except CollectiveError as exc:
        raise CollectiveError(f"{exc}. {EVERY_RANK}") from None


def step_records(timer: StepTimer | None) -> dict | None:
    """The timer's steps not yet stored (a copy), or None without a timer."""
    if timer is None:
        return None
    if not isinstance(timer, StepTimer):
        raise TypeError(f"timer must be a ckptfmt.StepTimer, not {type(timer).__name__}")
    return timer.snapshot()
