"""verify(): check that every byte of a checkpoint, or of a whole repository, is intact.

Each distinct chunk is read once and hashed; a problem names the checkpoint,
the chunk and every tensor that uses it. With ``stats``, each tensor's recorded
statistics are recomputed from the bytes just verified (tools/stats_check.py).
Progress goes to an fsspec ``Callback`` (bytes), which drives the CLI's bar and
the TUI's widget alike.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsspec.callbacks import Callback, NoOpCallback

from ckptfmt._platform import single_threaded_kernels
from ckptfmt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptDataError,
    ManifestError,
    StorageError,
    UnsupportedVersionError,
)
from ckptfmt.format import layout
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.parity_record import record_key
from ckptfmt.format.shards import chunk_rows
from ckptfmt.format.signatures import TrustedKeys, trusted_public_keys
from ckptfmt.format.values import decode_tree
from ckptfmt.loading.chunkio import ChunkReader
from ckptfmt.repository.copies import copy_records
from ckptfmt.repository.history import history_keys, read_history
from ckptfmt.repository.leases import saves_running_or_killed
from ckptfmt.repository.lost_commits import lost_commits
from ckptfmt.repository.repository import CommitRecord, Repository, resolve
from ckptfmt.repository.signatures import judge, signature_problems
from ckptfmt.storage.budget import ByteBudget
from ckptfmt.storage.factory import open_storage
from ckptfmt.tools import describe
from ckptfmt.tools.formatting import counted
from ckptfmt.tools.node_parity_check import check_node_parity
from ckptfmt.tools.parity_check import annotate, check_parity

if TYPE_CHECKING:
    from ckptfmt.tools.stats_check import StatsCheck


@dataclass(frozen=True)
class Problem:
    """One thing found wrong: what, where, and which tensors it damages."""

    kind: str  # "missing-chunk", "corrupt-chunk", "bad-checkpoint", "missing-commit", "unsigned", "bad-signature",
    # "wrong-stats", "bad-history", "bad-parity"
    checkpoint: str
    message: str
    chunk: str | None = None
    tensors: tuple[str, ...] = ()
    #: The damaged object's key in the repository (a chunk of one hash may be stored under several codecs;
    #: also a manifest or a parity object).
    key: str | None = None
    #: In a checkpoint with parity (spec 5.6): whether parity can rebuild the object, for people.
    parity: str | None = None


@dataclass
class VerifyReport:
    """The outcome of a verify run."""

    url: str
    checkpoints: list[str] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    #: Things worth knowing that are not damage: entries of the repository that readers ignore.
    warnings: list[str] = field(default_factory=list)
    #: The run was stopped through ``cancel`` before it had checked everything.
    cancelled: bool = False
    #: Tensors whose statistics were recomputed (``stats=True``); -1 when not asked.
    stats_checked: int = -1
    #: Replicated tensors whose copies differed between ranks when a checkpoint was saved (spec 9.7):
    #: the manifest's entries, each with its ``checkpoint``. Not damage: the stored copy is the majority's.
    divergences: list[dict] = field(default_factory=list)
    #: History objects (spec 4.5: removed checkpoints' run history) read and checked, repositories only.
    histories_checked: int = 0
    #: Checkpoints with parity (spec 5.6) whose parity was checked, and the parity bytes read.
    protected: list[str] = field(default_factory=list)
    parity_bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems and not self.cancelled

    @property
    def damaged_tensors(self) -> list[str]:
        return sorted({f"{p.checkpoint}:{t}" for p in self.problems for t in p.tensors})


def verify(url: str | os.PathLike, *, storage_options: dict | None = None,
           callback: Callback | None = None, workers: int = 16,
           cancel: threading.Event | None = None, stats: bool = False,
           trusted_keys: TrustedKeys = None, node: str | None = None) -> VerifyReport:
    """Verify a checkpoint URL, or every checkpoint of a repository URL.

    A checkpoint URL naming no committed checkpoint raises CheckpointNotFoundError:
    a wrong name is not damage. Setting ``cancel`` (from any thread) stops the run:
    chunks not yet started are skipped and the report says ``cancelled``.
    ``stats``: also recompute every tensor's recorded statistics (spec 6.10) from
    its verified bytes; one that disagrees is a ``wrong-stats`` problem.
    Every signature object must sign its checkpoint under its own key (``bad-signature``);
    with ``trusted_keys`` (spec 10.3), a checkpoint no trusted key signed is ``unsigned``
    and one whose trusted signature does not verify (forged or damaged) ``bad-signature``.
    In a node-scoped repository (spec 9.8) the chunks of ``node`` (default: this machine's hostname) are
    checked, the others named as held on their nodes; where ``node`` is none of the checkpoint's, all.
    """
    trusted = None if trusted_keys is None else trusted_public_keys(trusted_keys)
    callback = callback or NoOpCallback()
    started = time.perf_counter()
    repo, names, ignored, whole_repository = _target(url, storage_options)
    report = VerifyReport(url=os.fspath(url), checkpoints=names)
    manifests, protected = _read_manifests(repo, names, whole_repository, trusted, cancel, report)
    if ignored:
        _report_lost_commits(repo, ignored, manifests, report)
    if whole_repository:
        report.histories_checked, problems = _history_problems(repo)
        report.problems += problems
    _report_divergences(manifests, report)
    here = _rows_here(repo, manifests, node or socket.gethostname(), report)
    check = _stats_check(manifests) if stats else None
    check_chunks(repo, manifests, report, callback, workers, cancel, check, here)
    if check is not None and not report.cancelled:
        for wrong in check.finish(repo):
            report.problems.append(Problem("wrong-stats", wrong.checkpoint, wrong.message, tensors=(wrong.tensor,)))
        report.stats_checked = len(check.tensors) + len(check.streamed)
    if protected and not report.cancelled:
        _check_parity(repo, protected, report, callback, workers)
    if not report.cancelled:
        _check_node_parity(repo, manifests, node or socket.gethostname(), report)
    report.seconds = time.perf_counter() - started
    return report


def _target(url: str | os.PathLike, storage_options: dict | None) -> tuple[Repository, list[str], list[str], bool]:
    """What ``url`` names: (its repository, the checkpoints to verify, the listing's ignored entries,
    whether it is the whole repository)."""
    storage = open_storage(url, storage_options)
    if not storage.exists(layout.MARKER_KEY):
        repo, name = resolve(url, storage_options)
        return repo, [name], [], False
    repo = Repository(storage)
    repo.check_marker()
    listing = repo.listing()
    return repo, listing.checkpoints, listing.ignored, True


def _read_manifests(repo: Repository, names: list[str], whole_repository: bool, trusted: dict[str, bytes] | None,
                    cancel: threading.Event | None,
                    report: VerifyReport) -> tuple[dict[str, Manifest], dict[str, CommitRecord]]:
    """The manifests of checkpoints ``names`` and the commit records of those with parity, each one's
    signatures and value tree checked; one that cannot be read is a ``bad-checkpoint`` problem (but a
    checkpoint URL naming no checkpoint raises, and so does a store that fails)."""
    manifests: dict[str, Manifest] = {}
    protected: dict[str, CommitRecord] = {}
    for name in names:
        if _is_set(cancel):
            report.cancelled = True
            break
        record = None
        try:
            record = repo.commit(name)
            if record.parity is not None:
                protected[name] = record
            manifests[name] = repo.manifest(name, record)
        except StorageError:  # the store failed, not the data: no verdict
            raise
        except CheckpointError as exc:
            if not whole_repository and not repo.storage.exists(layout.commit_key(name)):
                raise  # no such checkpoint
            manifest_key = None if record is None else layout.manifest_key(name, record.manifest_hash)
            report.problems.append(Problem("bad-checkpoint", name, str(exc), key=manifest_key))
            continue
        report.problems += _signature_problems(repo, record, trusted) + _value_tree_problems(name, manifests[name])
    return manifests, protected


def _report_divergences(manifests: dict[str, Manifest], report: VerifyReport) -> None:
    """A warning, and the records, of each checkpoint whose replicated tensors differed between ranks."""
    for name, manifest in manifests.items():
        divergent = describe.replica_divergences({"replicas": manifest.replicas})
        if divergent:
            report.divergences += [{"checkpoint": name, **entry} for entry in
                                   describe.records((manifest.replicas or {}).get("divergent"))]
            report.warnings.append(f"{name}: the copies of replicated tensors differed between ranks when it was "
                                   f"saved (the majority's was stored): {'; '.join(divergent)}")


def _check_parity(repo: Repository, protected: dict[str, CommitRecord], report: VerifyReport, callback: Callback,
                  workers: int) -> None:
    """Check each protected checkpoint's parity record and objects (spec 5.6), report what is damaged in
    them, and say of every damaged object whether parity rebuilds it."""
    checks = {}
    for name, record in protected.items():
        assert record.parity is not None
        found = checks[name] = check_parity(repo.storage, name, record.parity, workers=workers, callback=callback)
        report.parity_bytes_checked += found.bytes_checked
        if found.error is not None:
            report.problems.append(Problem("bad-parity", name, found.error,
                                           key=record_key(name, record.parity)))
        for key, why in found.damaged_copies:
            report.problems.append(Problem("bad-parity", name, f"{repo.storage.describe(key)}: "
                                           f"{'missing' if why == 'missing' else why}", key=key,
                                           parity="another copy restores it"))
        for key, why in sorted(found.bad_parity.items()):
            report.problems.append(Problem("bad-parity", name, why, key=key))
    report.protected = sorted(checks)
    report.problems = annotate(report.problems, checks)


def _check_node_parity(repo: Repository, manifests: dict[str, Manifest], node: str, report: VerifyReport) -> None:
    """The parity across nodes ``node`` keeps of each node-scoped checkpoint it is a node of (spec 9.8)."""
    for name, manifest in manifests.items():
        if manifest.placement is None or manifest.placement.node(node) is None:
            continue
        found = check_node_parity(repo, name, repo.commit(name).manifest_hash, manifest, node)
        if found is not None:
            report.parity_bytes_checked += found.bytes_checked
            report.problems += [Problem("bad-parity", name, why, key=key) for key, why in sorted(found.damaged.items())]


def _signature_problems(repo: Repository, record: CommitRecord, trusted: dict[str, bytes] | None) -> list[Problem]:
    """A checkpoint's signature objects that do not sign it; with ``trusted`` keys, also no trusted one."""
    found = [Problem("bad-signature", record.name, message) for message in signature_problems(repo, record)]
    if trusted is not None:
        verdict = judge(repo, record, trusted)
        if verdict.problem is not None and not (found and verdict.problem == "bad-signature"):
            found.append(Problem(verdict.problem, record.name, verdict.message))
    return found


def _value_tree_problems(name: str, manifest: Manifest) -> list[Problem]:
    """The state and the user metadata decode (spec 7) and every tensor reference is within the table:
    what a load meets once every chunk has been read, found without reading one."""
    tensors = len(manifest.tensors)

    def in_table(index: int) -> None:
        if not 0 <= index < tensors:
            raise ManifestError(f"the state refers to tensor {index}, the table has {tensors}")

    try:
        decode_tree(manifest.state, in_table)
        decode_tree(manifest.user)
    except CheckpointError as exc:
        return [Problem("bad-checkpoint", name, str(exc))]
    return []


def _history_problems(repo: Repository) -> tuple[int, list[Problem]]:
    """Every history object read and checked against its key: a damaged one is a ``bad-history`` problem
    (named by the removed checkpoint it keeps the history of)."""
    problems, keys = [], history_keys(repo)
    for key in keys:
        try:
            read_history(repo, key)
        except (CorruptDataError, ManifestError) as exc:
            problems.append(Problem("bad-history", key.name, f"{exc}; `ckptfmt repair {repo.url} --from COPY` "
                                    "restores it from a copy of the repository", key=key.key))
        except UnsupportedVersionError as exc:  # one unreadable history object: the rest are still checked
            problems.append(Problem("bad-history", key.name, str(exc), key=key.key))
    return len(keys), problems


def _report_lost_commits(repo: Repository, ignored: list[str], manifests: dict[str, Manifest],
                         report: VerifyReport) -> None:
    """Checkpoints that lost their commit record are problems (they vanished from every listing); the rest
    of what readers ignore is a warning. While a save runs, or where one was killed (its lease is still
    there, unreleased), an index entry alone proves nothing: it may be committing right now, or be what
    the killed save left just before its commit (``ckptfmt gc`` reclaims it)."""
    lost = lost_commits(repo, ignored, {name: m.parent for name, m in manifests.items()})
    if lost and not all(found.certain for found in lost) and saves_running_or_killed(repo):
        lost = [found for found in lost if found.certain]
    for found in lost:
        report.problems.append(Problem("missing-commit", found.name, found.message(repo.url)))
    others = sorted(set(ignored) - {found.name for found in lost})
    if others:
        report.warnings.append(f"ignored {counted(len(others), 'entry', 'entries')} that are not committed "
                               f"checkpoints (foreign files, invalid names or unfinished saves): {', '.join(others)}")


def _stats_check(manifests: dict[str, Manifest]) -> StatsCheck:
    """The statistics check of ``verify --stats``: it reduces tensors, so torch is loaded then, and only then."""
    from ckptfmt.tools.stats_check import StatsCheck

    return StatsCheck(manifests)


def _is_set(event: threading.Event | None) -> bool:
    return event is not None and event.is_set()


#: Chunk bytes in memory at once across the verify threads (one bigger chunk runs alone), and the
#: largest read buffer a thread keeps for the next chunk: 16 threads x 4 GiB chunks must not mean 64 GiB.
_MEMORY_BUDGET = 2**30
_REUSED_BUFFER = 64 * 2**20


def _checked_in_place(reader: ChunkReader, index: int, spread: bool) -> bool:
    """Check an uncompressed chunk of a local file where the page cache holds it (a map: no copy into
    memory; ``spread``: one hash over every core, where there are fewer chunks than cores); False
    where it cannot be mapped (compressed, an object store), to be read instead."""
    if not reader.can_read_into(index, reader.chunks[index].size):
        return False
    reader.check_stored_size(index)
    mapped = reader.mapped(index, parallel=spread)
    if mapped is None:
        return False
    mapped.close()
    return True


def _rows_here(repo: Repository, manifests: dict[str, Manifest], node: str,
               report: VerifyReport) -> dict[str, set[int]]:
    """The chunk rows ``node`` holds of each node-scoped checkpoint it is a node of (spec 9.8): its own,
    and those of the nodes it has a copy record for; the rest are named in the report as held on their
    nodes."""
    here = {}
    for name, manifest in manifests.items():
        placement = manifest.placement
        held = placement.node(node) if placement is not None else None
        if placement is None or held is None:
            continue
        copies = copy_records(repo, name, repo.commit(name).manifest_hash, damaged=report.warnings)
        copied = [n for n in placement.nodes if n.host in copies and n.host != node]
        here[name] = set(held.rows).union(*(n.rows for n in copied))
        elsewhere = len(manifest.chunks) - len(here[name])
        if elsewhere:
            others = ", ".join(n.host for n in placement.nodes if n.host != node and n not in copied)
            report.warnings.append(f"{name}: {counted(elsewhere, 'chunk')} held on other nodes ({others}), "
                                   f"not checked on {node}")
    return here


def _chunk_users(manifests: dict[str, Manifest], here: dict[str, set[int]]) -> dict[str, list[tuple[str, str]]]:
    """Each chunk's users, by its stored key: (checkpoint, tensor key) for every tensor with a piece in it
    (on this node, for a node-scoped checkpoint)."""
    users: dict[str, list[tuple[str, str]]] = {}
    for name, manifest in manifests.items():
        held = here.get(name)
        for tensor in manifest.tensors:
            for row in dict.fromkeys(chunk_rows(tensor.shards)):
                if held is None or row in held:
                    users.setdefault(stored_key(manifest.chunks, manifest.chunks[row]), []).append((name, tensor.key))
    return users


def check_chunks(repo: Repository, manifests: dict[str, Manifest], report: VerifyReport,
                 callback: Callback | None = None, workers: int = 16, cancel: threading.Event | None = None,
                 stats: StatsCheck | None = None, here: dict[str, set[int]] | None = None) -> None:
    """Read and hash every distinct chunk the ``manifests`` use, once; add what is missing or corrupt
    to ``report.problems`` (one problem per checkpoint that uses the chunk). ``here``: per node-scoped
    checkpoint, the rows this node holds (only those are checked)."""
    here = here or {}
    callback = callback or NoOpCallback()
    # Each distinct chunk once; who uses it, to name the damage, is worked out at the first problem (a
    # clean verify of 100,000 tensors builds no tensor entry).
    users: dict[str, list[tuple[str, str]]] | None = None
    jobs: dict[str, tuple[Manifest, int]] = {}
    for name, manifest in manifests.items():
        held = here.get(name)
        for index, chunk in enumerate(manifest.chunks):
            if held is None or index in held:
                jobs.setdefault(stored_key(manifest.chunks, chunk), (manifest, index))
    callback.set_size(sum(m.chunks[i].size for m, i in jobs.values()))
    lock = threading.Lock()
    budget = ByteBudget(_MEMORY_BUDGET)
    buffers = threading.local()  # one reusable read buffer per thread: fresh memory costs page faults

    def buffer(size: int) -> memoryview:
        if size > _REUSED_BUFFER:  # rare, big chunks: held only while checked
            return memoryview(bytearray(size))
        current = getattr(buffers, "data", None)
        if current is None or len(current) < size:
            current = buffers.data = bytearray(size)
        return memoryview(current)[:size]

    failed = threading.Event()  # a storage failure ends the run: the other jobs return at once
    spread = len(jobs) < (os.cpu_count() or 1)

    def check(item) -> None:
        nonlocal users
        ident, (manifest, index) = item
        if failed.is_set():
            return
        if _is_set(cancel):
            report.cancelled = True
            return
        reader = ChunkReader(repo.storage, manifest.chunks, remember=True)  # for later reads with verify="once"
        chunk = manifest.chunks[index]
        try:
            if stats is not None or not _checked_in_place(reader, index, spread):
                with budget.take(chunk.size):
                    if reader.can_read_into(index, chunk.size):
                        reader.check_stored_size(index)  # before memory is set aside for what the manifest claims
                        data = buffer(chunk.size)
                        reader.read_into(index, data)
                    else:
                        data = memoryview(reader.read(index))
                    if stats is not None:
                        stats.measure(ident, data)
            problem = None
        except CheckpointNotFoundError as exc:
            problem = ("missing-chunk", str(exc))
        except StorageError:  # the store failed, not the data: no verdict
            failed.set()
            raise
        except CheckpointError as exc:
            problem = ("corrupt-chunk", str(exc))
        with lock:
            report.chunks_checked += 1
            report.bytes_checked += chunk.size
            if problem:
                users = _chunk_users(manifests, here) if users is None else users
                for checkpoint in sorted({n for n, _ in users.get(ident, [])}) or [manifest.name]:
                    keys = tuple(sorted({k for n, k in users.get(ident, []) if n == checkpoint}))
                    report.problems.append(Problem(problem[0], checkpoint, problem[1], chunk.hash, keys,
                                                   stored_key(manifest.chunks, chunk)))
        callback.relative_update(chunk.size)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptfmt-verify",
                            initializer=single_threaded_kernels) as pool:
        list(pool.map(check, jobs.items()))
