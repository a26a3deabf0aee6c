"""Arrow tables built in child processes, so that building a long run's tables uses every core.

Parsing manifests and decoding their step records is Python work that holds
the GIL: threads only overlap the reads. A child is a fresh interpreter started
by fork and exec (so the caller's threads and its ``__main__`` are no concern)
with the caller's ``sys.path`` (so it imports the modules the caller would), a
worker module's ``main(fd)`` run in it. It reads its task from stdin (bytes the
caller wrote), builds its tables, and writes them as Arrow IPC streams into the
file ``fd`` the caller made for it: memory with no name (``memfd_create``) on
Linux, else an unlinked temporary file. After them comes its account (pickled,
between two processes of this library, in a file only they hold): where each
table lies, the warnings it raised, or its error. The caller maps the file and
reads the tables in place (a pipe moved them at a third of a GB/s here), and
raises the warnings and errors again as they were raised. While its tables
live, their memory holds one descriptor open (CPython's ``mmap`` keeps one).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from ckptfmt._platform import die_with_parent
from ckptfmt.errors import CheckpointError

#: How the account's length closes the file the child writes.
_TRAILER = struct.Struct("<Q")
#: The child's program: the caller's sys.path, then the worker module's main(fd).
_BOOT = ("import importlib, json, sys; sys.path[:] = json.loads(sys.argv[2]); "
         "importlib.import_module(sys.argv[1]).main(int(sys.argv[3]))")


class TaskRefused(Exception):
    """The child could not load its task (an object in it that only the caller can rebuild)."""


def children_possible() -> bool:
    """Whether this process can start table children: a POSIX system (descriptors handed down, maps),
    and an interpreter to run (not an embedded or frozen one)."""
    return os.name == "posix" and bool(sys.executable) and not getattr(sys, "frozen", False)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, within its cgroup's CPU quota (a container's
    share of a big machine)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 quota here
        pass
    return cores


class TableProcess:
    """A child building tables: started at once; ``result`` waits for it and maps what it wrote."""

    def __init__(self, module: str, task: bytes):
        if hasattr(os, "memfd_create"):
            self._file = os.fdopen(os.memfd_create("ckptfmt-tables", os.MFD_CLOEXEC), "w+b")
        else:
            self._file = tempfile.TemporaryFile(prefix="ckptfmt-tables-")  # noqa: SIM115 (closed by result, stop)
        fd = self._file.fileno()
        try:
            self.process = subprocess.Popen([sys.executable, "-c", _BOOT, module, json.dumps(sys.path), str(fd)],
                                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, pass_fds=[fd])
        except BaseException:
            self._file.close()
            raise
        self._stderr = b""
        self._thread = threading.Thread(target=self._talk, args=(task,), daemon=True,
                                        name=f"ckptfmt-{module.rsplit('.', 1)[-1]}")
        self._thread.start()

    def _talk(self, task: bytes) -> None:
        try:
            self._stderr = self.process.communicate(task)[1]
        except OSError:  # the child is gone before reading its task: its exit status tells
            self.process.wait()

    def result(self) -> dict[str, pa.Table]:
        """The child's tables, by name, once it is done; its warnings raised again here, and its error;
        ``TaskRefused`` where it could not load its task."""
        self._thread.join()
        account = self._account()
        for message, category in account.get("warned", ()):
            warnings.warn(message, category, stacklevel=2)
        if "refused" in account:
            raise TaskRefused(account["refused"])
        if "error" in account:
            raise account["error"]
        size = self._file.seek(0, os.SEEK_END)
        data = pa.py_buffer(mmap.mmap(self._file.fileno(), size, prot=mmap.PROT_READ))
        self._file.close()  # the map keeps the memory; the tables are views of it
        return {name: pa.ipc.open_stream(data.slice(offset, length)).read_all()
                for name, offset, length in account["tables"]}

    def _account(self) -> dict[str, Any]:
        """What the child wrote after its tables; a failure named in one line where it wrote none."""
        code = self.process.returncode
        end = self._file.seek(0, os.SEEK_END)
        if code == 0 and end >= _TRAILER.size:
            self._file.seek(end - _TRAILER.size)
            (length,) = _TRAILER.unpack(self._file.read(_TRAILER.size))
            if length <= end - _TRAILER.size:
                self._file.seek(end - _TRAILER.size - length)
                try:
                    return pickle.loads(self._file.read(length))
                except Exception as exc:  # an error class the caller cannot rebuild, say
                    raise CheckpointError(f"a process building analytics tables gave an account this one "
                                          f"cannot read: {exc}") from None
        if code is not None and code < 0:
            said = f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"exit {code}"
        else:
            lines = self._stderr.decode(errors="replace").strip().splitlines()
            said = f"exit {code}" + (f": {lines[-1]}" if lines else ": it wrote no tables")
        raise CheckpointError(f"a process building analytics tables failed ({said})")

    def stop(self) -> None:
        """Kill the child if it still runs (the caller gave up: another share failed, or an interrupt)."""
        if self.process.poll() is None:
            self.process.kill()
        self._thread.join()
        self._file.close()


def serve(build: Callable[[Any], dict[str, pa.Table]], fd: int) -> None:
    """A child's whole work: its task from stdin, ``build(task)``'s tables and then its account into
    the file ``fd``."""
    die_with_parent()  # a caller killed outright leaves no child building for nobody
    with os.fdopen(fd, "wb", buffering=0) as file:
        account = _built(build, file)
        encoded = pickle.dumps(account)
        file.write(encoded + _TRAILER.pack(len(encoded)))


def _built(build: Callable[[Any], dict[str, pa.Table]], file) -> dict[str, Any]:
    try:
        task = pickle.loads(sys.stdin.buffer.read())
    except Exception as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the caller's filters decide
        try:
            tables = build(task)
        except CheckpointError as exc:
            return {"error": _portable(exc), "warned": _warned(caught)}
        except Exception:
            traceback.print_exc()  # the caller names its last line
            raise SystemExit(1) from None
    sink = pa.PythonFile(file, mode="w")
    placed = []
    for name, table in tables.items():
        start = sink.tell()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        placed.append((name, start, sink.tell() - start))
    return {"tables": placed, "warned": _warned(caught)}


def _portable(error: CheckpointError) -> CheckpointError:
    """``error`` if it pickles and unpickles whole (its class, its attributes), else a CheckpointError
    of its message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return CheckpointError(str(error))


def _warned(caught: list[warnings.WarningMessage]) -> list[tuple[str, type[Warning]]]:
    """The warnings raised, as (message, category); a category of the caller's own code as UserWarning."""
    portable = (lambda c: c.__module__ == "builtins" or c.__module__.startswith("ckptfmt."))
    return [(str(w.message), w.category if portable(w.category) else UserWarning) for w in caught]
