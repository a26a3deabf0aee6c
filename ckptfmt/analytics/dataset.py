"""Runs' tables as a run-partitioned Parquet dataset that grows with them (spec/ANALYTICS.md, "Dataset").

``export_incremental(repos, out)`` appends to ``OUT/<table>/run=<label>/part-<n>.parquet`` the rows of
the checkpoints not exported yet: it reads only their manifests (or removed checkpoints' history
objects), never again those of checkpoints ``OUT/_state/run=<label>.json`` names. Each export
writes its parts under temporary names, fsyncs and renames them, and only then replaces the state
file (temporary file, fsync, rename): a killed export leaves the previous state whole, and parts
the state does not name, which the next export removes before it reads. An export holds a lock file
per run (``OUT/_state/run=<label>.lock``) while it works: a second export of the run would take the
first one's new parts for a killed export's and remove them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ckptfmt.analytics.table_build import build, runs, saved
from ckptfmt.analytics.table_columns import TABLE_NAMES
from ckptfmt.errors import CheckpointError
from ckptfmt.format.history import HistoryKey
from ckptfmt.repository.repository import Repository

STATE_DIR = "_state"
STATE_VERSION = 1
#: A run label, as a folder name (``run=<label>``) every reader takes as it is: no escaping.
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_PART = re.compile(r"part-(\d{6,})\.parquet")


class DatasetStateError(CheckpointError, ValueError):
    """A dataset's state file is not one ``export_incremental`` wrote (damaged or foreign)."""


@dataclass
class Appended:
    """What an incremental export added: rows per table, and the checkpoints (and removed checkpoints'
    history objects) it read, and those it skipped as exported before."""

    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TABLE_NAMES, 0))
    read: int = 0
    skipped: int = 0


def export_incremental(repos: str | os.PathLike | Iterable | Mapping[str, str | os.PathLike],
                       out: str | os.PathLike, *, storage_options: dict | None = None,
                       workers: int | None = None, processes: int | None = None) -> Appended:
    """Append the rows of each run's checkpoints not yet in the dataset ``out`` to it.

    ``repos``: one repository URL, several, or a mapping of run label -> URL; without labels, a run is
    labelled by a safe form of its repository's name (``default_label``). Labels are folder names:
    letters, digits, ``.``, ``_``, ``-``. ``workers``, ``processes``: as for ``tables``.
    """
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder}: the dataset's folder is a file")
    labelled = runs(repos) if isinstance(repos, Mapping) else [(default_label(url), url) for _, url in runs(repos)]
    seen: set[str] = set()
    for label, _ in labelled:
        if not LABEL.fullmatch(label):
            raise CheckpointError(f"run label {label!r} is no folder name: use letters, digits, '.', '_', '-' "
                                  "(at most 128, starting with a letter or digit)")
        if label in seen:
            raise CheckpointError(f"two runs are labelled {label!r}: give each its own label")
        seen.add(label)
    total = Appended()
    for label, url in labelled:
        repo = Repository.open(url, storage_options)
        appended = _export_run(folder, label, repo, _where(repo.url),
                               {"workers": workers, "processes": processes, "storage_options": storage_options})
        total.read += appended.read
        total.skipped += appended.skipped
        for name, rows in appended.rows.items():
            total.rows[name] += rows
    return total


def default_label(url: str | os.PathLike) -> str:
    """A run label for a repository: its URL's last segment, with what a label cannot hold as ``_``."""
    name = os.fspath(url).rstrip("/").rsplit("/", 1)[-1]
    label = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:128]
    return label if LABEL.fullmatch(label) else f"run{label}"[:128]


def _where(url: str) -> str:
    """A repository's URL as the state records it: a local path made absolute."""
    return url if "://" in url else os.path.abspath(url)


def _export_run(folder: Path, label: str, repo: Repository, url: str, building: dict) -> Appended:
    with _run_lock(folder / STATE_DIR / f"run={label}.lock", label):
        return _export_locked(folder, label, repo, url, building)


@contextlib.contextmanager
def _run_lock(path: Path, label: str) -> Iterator[None]:
    """Hold the run's lock file for the block. A lock left by a process of this host that no longer runs
    (a killed export) is taken over; any other is refused, naming its holder."""
    _make_folders(path.parent)
    mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _lock_holder(path)
            if holder is None or holder["host"] != socket.gethostname() or _alive(holder["pid"]):
                held = f"process {holder['pid']} on {holder['host']}" if holder else "an unreadable lock"
                raise CheckpointError(f"{path}: another export of run {label!r} is in progress ({held}); if "
                                      "none is, remove this file") from None
            path.unlink(missing_ok=True)  # its holder was killed: taken over
            continue
        try:
            os.write(fd, mine)
        finally:
            os.close(fd)
        break
    else:
        raise CheckpointError(f"{path}: another export of run {label!r} took the lock at the same time")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _lock_holder(path: Path) -> dict | None:
    """The pid and host a lock file names, or None where it names none (being written, or damaged)."""
    try:
        holder = json.loads(path.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if isinstance(holder, dict) and type(holder.get("pid")) is int and isinstance(holder.get("host"), str):
        return holder
    return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _export_locked(folder: Path, label: str, repo: Repository, url: str, building: dict) -> Appended:
    """``building``: ``build``'s options (workers, processes, storage options)."""
    state_path = folder / STATE_DIR / f"run={label}.json"
    state = _read_state(state_path, label, url)
    for name in TABLE_NAMES:
        _remove_orphans(folder / name / f"run={label}", set(state["parts"].get(name, [])))
    exported = {(n, c) for n, c in state["checkpoints"]} | {(n, c) for n, c in state["histories"]}
    every = saved(repo)
    new = [item for item in every if (item.name, item.created_ns) not in exported]
    appended = Appended(read=len(new), skipped=len(every) - len(new))
    if not new:
        return appended
    built = build([(label, repo, new)], **building)
    known = set(state["environments"])
    environments = built["environments"]
    built["environments"] = environments.filter(pc.invert(pc.is_in(environments["environment_id"],
                                                                    pa.array(sorted(known), pa.int64()))))
    part = f"part-{state['exports']:06d}.parquet"
    changed: set[Path] = set()  # folders whose entries changed
    for name, table in built.items():
        if table.num_rows:
            partition = folder / name / f"run={label}"
            changed.update(_make_folders(partition), [partition])
            _write_part(partition / part, _with_run(table, label))
            state["parts"].setdefault(name, []).append(part)
            appended.rows[name] = table.num_rows
    _fsync_folders(changed)  # the parts' names reach the disk before the state that names them
    state["exports"] += 1
    state["environments"] = sorted(known | set(environments["environment_id"].to_pylist()))
    for item in new:
        state["histories" if isinstance(item, HistoryKey) else "checkpoints"].append([item.name, item.created_ns])
    _write_durably(state_path, json.dumps(state, separators=(",", ":")).encode())
    return appended


def _with_run(table: pa.Table, label: str) -> pa.Table:
    """The table with ``run`` as plain strings (what a hive partition's readers expect), added where absent."""
    run = pa.repeat(pa.scalar(label, pa.string()), table.num_rows)
    if "run" in table.column_names:
        return table.set_column(table.column_names.index("run"), "run", run)
    return table.add_column(0, "run", run)


# -- the state -----------------------------------------------------------------------------------
def _read_state(path: Path, label: str, url: str) -> dict:
    """The run's state: what was exported (checkpoints and history objects as [name, created_ns], the
    environment ids, each table's parts) and how many exports wrote parts; empty where none was."""
    if not path.exists():
        return {"version": STATE_VERSION, "run": label, "repository": url, "exports": 0, "checkpoints": [],
                "histories": [], "environments": [], "parts": {}}
    try:
        state = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise DatasetStateError(f"{path}: the dataset's state file is not JSON ({exc}); remove the run's "
                                "folders and this file to export the run again") from None
    problem = _state_problem(state, label)
    if problem:
        raise DatasetStateError(f"{path}: the dataset's state file is damaged: {problem}; remove the run's "
                                "folders and this file to export the run again")
    if state["repository"] != url:
        raise CheckpointError(f"{path}: run {label!r} of this dataset is {state['repository']}, not {url}: "
                              "give this run another label")
    return state


def _state_problem(state: object, label: str) -> str | None:
    """What is wrong with a parsed state file, or None."""
    if not isinstance(state, dict):
        return "not a map"
    if state.get("version") != STATE_VERSION or state.get("run") != label:
        return f"version {state.get('version')!r} of run {state.get('run')!r}, not {STATE_VERSION} of {label!r}"
    if not isinstance(state.get("repository"), str) or type(state.get("exports")) is not int:
        return "no repository or export count"
    for key in ("checkpoints", "histories"):
        items = state.get(key)
        if not isinstance(items, list) or not all(
                isinstance(i, list) and len(i) == 2 and isinstance(i[0], str) and type(i[1]) is int for i in items):
            return f"{key} is not a list of [name, created_ns]"
    if not isinstance(state.get("environments"), list) or not all(type(i) is int for i in state["environments"]):
        return "environments is not a list of ids"
    parts = state.get("parts")
    if not isinstance(parts, dict) or not all(
            name in TABLE_NAMES and isinstance(names, list) and all(isinstance(n, str) and _PART.fullmatch(n)
                                                                    for n in names)
            for name, names in parts.items()):
        return "parts is not a map of table -> part file names"
    return None


# -- durable files -------------------------------------------------------------------------------
def _remove_orphans(partition: Path, named: set[str]) -> None:
    """Remove a killed export's files from a run's folder of a table: parts the state does not name,
    and temporary files. Other files are left alone."""
    if not partition.is_dir():
        return
    for path in partition.iterdir():
        if (_PART.fullmatch(path.name) and path.name not in named) or (
                path.name.startswith(".part-") and path.name.endswith(".tmp")):
            path.unlink()


def _make_folders(path: Path) -> list[Path]:
    """Make ``path`` and its missing parents; returns the folders that gained an entry."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for each in reversed(missing):
        each.mkdir()
    return [each.parent for each in missing]


def _write_part(path: Path, table: pa.Table) -> None:
    """Write a part under a temporary name, fsync it and rename it (its folder is not fsynced here)."""
    temporary = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, temporary)
    _fsync(temporary)
    os.replace(temporary, path)


def _write_durably(path: Path, data: bytes) -> None:
    changed = {*_make_folders(path.parent), path.parent}
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    _fsync_folders(changed)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folders(folders: Iterable[Path]) -> None:
    for folder in folders:
        _fsync(folder)
