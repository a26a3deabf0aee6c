"""Arrow tables built in child processes, so that building a long run's tables uses every core.

Parsing manifests and decoding their step records is Python work that holds
the GIL: threads only overlap the reads. A child is a fresh interpreter
(``python -m MODULE FD``, started by fork and exec, so a parent's threads and
its ``__main__`` are no concern) that reads its task from stdin (bytes the
parent wrote), builds its tables and writes them as Arrow IPC streams into the
file ``FD`` the parent made for it: memory with no name (``memfd_create``) where
the platform has it, else an unlinked temporary file. The child says on stdout
where each table lies in it; the parent maps the file and reads the tables in
place (a pipe moved them at a third of a GB/s here). A ``CheckpointError`` in a
child is raised again in the parent as the same class with the same message;
any other failure as a ``CheckpointError`` naming the child's last line of
error output.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from ckptfmt import errors
from ckptfmt.errors import CheckpointError


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class TableProcess:
    """A child building tables: started at once; ``result`` waits for it and maps what it wrote."""

    def __init__(self, module: str, task: bytes):
        environment = dict(os.environ)
        source = str(Path(__file__).resolve().parents[2])  # the same ckptfmt as this process's
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [source, environment.get("PYTHONPATH")]))
        if hasattr(os, "memfd_create"):
            self._file = os.fdopen(os.memfd_create("ckptfmt-tables", os.MFD_CLOEXEC), "w+b")
        else:
            self._file = tempfile.TemporaryFile(prefix="ckptfmt-tables-")  # noqa: SIM115 (closed by result, stop)
        fd = self._file.fileno()
        self.process = subprocess.Popen([sys.executable, "-m", module, str(fd)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment,
                                        pass_fds=[fd])
        self._said: tuple[bytes, bytes] = (b"", b"")
        self._thread = threading.Thread(target=self._talk, args=(task,), daemon=True,
                                        name=f"ckptfmt-{module.rsplit('.', 1)[-1]}")
        self._thread.start()

    def _talk(self, task: bytes) -> None:
        try:
            self._said = self.process.communicate(task)
        except OSError:  # the child is gone before reading its task: its exit status tells
            self.process.wait()

    def result(self) -> dict[str, pa.Table]:
        """The child's tables, by name, once it is done; its error raised here if it failed."""
        self._thread.join()
        out, err = self._said
        try:
            said = json.loads(out) if out else None
        except ValueError:
            said = None
        if self.process.returncode or not isinstance(said, dict):
            lines = err.decode(errors="replace").strip().splitlines()
            raise CheckpointError(f"a process building analytics tables failed (exit {self.process.returncode})"
                                  + (f": {lines[-1]}" if lines else ""))
        if "error" in said:
            name, message = said["error"]
            error = getattr(errors, name, None)
            raise (error if isinstance(error, type) and issubclass(error, CheckpointError)
                   else CheckpointError)(message)
        size = os.fstat(self._file.fileno()).st_size
        data = pa.py_buffer(mmap.mmap(self._file.fileno(), size, prot=mmap.PROT_READ)) if size else pa.py_buffer(b"")
        self._file.close()  # the map keeps the memory; the tables are views of it
        return {name: pa.ipc.open_stream(data.slice(offset, length)).read_all()
                for name, offset, length in said["tables"]}

    def stop(self) -> None:
        """Kill the child if it still runs (the parent gave up: another share failed, or an interrupt)."""
        if self.process.poll() is None:
            self.process.kill()
        self._thread.join()
        self._file.close()


def serve(build: Callable[[bytes], dict[str, pa.Table]]) -> None:
    """A child's whole work: the task's bytes from stdin, ``build(task)``'s tables into the file whose
    descriptor is its argument, and where each lies (or the error) to stdout as JSON."""
    try:
        tables = build(sys.stdin.buffer.read())
    except CheckpointError as exc:
        sys.stdout.write(json.dumps({"error": [type(exc).__name__, str(exc)]}))
        return
    except BaseException:
        traceback.print_exc()  # the parent names its last line
        raise SystemExit(1) from None
    placed = []
    with os.fdopen(int(sys.argv[1]), "wb", buffering=0) as file:
        sink = pa.PythonFile(file, mode="w")
        for name, table in tables.items():
            start = sink.tell()
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
            placed.append([name, start, sink.tell() - start])
    sys.stdout.write(json.dumps({"tables": placed}))
