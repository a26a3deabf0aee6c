"""The operating-system tricks ckptfmt relies on, in one place, each with its fallback.

- ``start_writeback``: Linux's ``sync_file_range`` starts writing a file's dirty
  pages without waiting (a hint; durability is still fsync's). Elsewhere: nothing.
- ``die_with_parent``: Linux's ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, so a child
  process never outlives the training process that started it.
- ``before_thread_shutdown``: run a function at interpreter exit *before*
  ``concurrent.futures`` refuses new work and joins its threads (threading's own
  exit hooks), where ``atexit`` would be too late.
- ``process_identity`` / ``process_gone``: a process named so that another
  process of the same machine (the same boot, the same process-id namespace:
  Linux's ``/proc``) can tell for sure that it has ended, its pid reused or not
  (its start time, in clock ticks since boot, differs). Elsewhere: None, and
  nothing is ever known gone.
- ``single_threaded_kernels``: the OpenMP runtime torch loaded (``libgomp``,
  ``libiomp5``, ``libomp``) runs this thread's torch operations on this thread
  alone (``omp_set_num_threads`` sets the calling thread's own limit). Elsewhere:
  nothing.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

#: Whether this platform kills a child when its parent dies (``die_with_parent`` works).
PARENT_DEATH_SIGNAL = sys.platform.startswith("linux")

_PR_SET_PDEATHSIG = 1
_SYNC_FILE_RANGE_WRITE = 2


def _libc_function(name: str, argtypes: list, restype) -> Callable | None:
    """A function of this process's C library, or None where there is none."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = restype
    return function


_SYNC_FILE_RANGE = _libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint],
                                  ctypes.c_int)


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the file's dirty pages now, without waiting for them.

    A save writes its chunks without fsync and syncs them all at the end; started
    early, the disk works while the save hashes and writes the next chunks, and
    the final fsyncs find little left to do. Only a hint: durability is still the fsync's.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def process_identity(pid: int | None = None) -> dict | None:
    """This process (or ``pid``) as ``{"boot", "pid_namespace", "pid", "start"}``: the machine's boot id, the
    process-id namespace, the pid and its start in clock ticks since boot; None where ``/proc`` does not
    say (not Linux), or the process does not exist."""
    pid = os.getpid() if pid is None else pid
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            boot = file.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
        start = _start_ticks(pid)
    except (OSError, ValueError, IndexError):
        return None
    return {"boot": boot, "pid_namespace": namespace, "pid": pid, "start": start}


def process_gone(identity: object) -> bool:
    """Whether the process ``identity`` names (``process_identity``'s, as another process stored it) has
    certainly ended: it ran on this boot of this machine, in this process's pid namespace, and no process
    of its pid and start time runs. False whenever that cannot be told (another machine or namespace, a
    malformed identity, no ``/proc``)."""
    if not isinstance(identity, dict) or type(identity.get("pid")) is not int or type(identity.get("start")) is not int:
        return False
    here = process_identity()
    if here is None or (identity.get("boot"), identity.get("pid_namespace")) != (here["boot"], here["pid_namespace"]):
        return False
    try:
        state, start = _stat(identity["pid"])
    except FileNotFoundError:
        return True
    except (OSError, ValueError, IndexError):
        return False
    return start != identity["start"] or state == "Z"  # another process now has the pid, or it died unreaped


def _start_ticks(pid: int) -> int:
    return _stat(pid)[1]


def _stat(pid: int) -> tuple[str, int]:
    """Fields 3 and 22 of ``/proc/PID/stat``: the process's state (``Z``: ended, not yet reaped) and its start in
    clock ticks since boot (the command name, field 2, may hold spaces and parentheses: the fields after its
    last ``)`` are counted)."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[19])


#: The OpenMP runtimes torch builds load, by the names the dynamic loader knows them by.
_OPENMP_RUNTIMES = ("libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.dylib")


def _openmp_set_num_threads() -> Callable | None:
    for name in _OPENMP_RUNTIMES:
        try:
            function = ctypes.CDLL(name).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        function.argtypes = [ctypes.c_int]
        function.restype = None
        return function
    return None


_OMP_SET_NUM_THREADS = _openmp_set_num_threads()


def single_threaded_kernels() -> None:
    """Run the torch operations of the calling thread on it alone, leaving every other thread's as
    they are.

    A save's chunk writers reduce each block of a tensor for its statistics; four of
    them each opening a team of OpenMP threads on a machine of two cores spent more
    time waking and parking threads than reducing (85,000 futex calls for one save).
    ``torch.set_num_threads`` cannot do this: it also changes MKL's count for the whole
    process, and so the training thread's matrix products while a save runs beside it.
    """
    if _OMP_SET_NUM_THREADS is not None:
        _OMP_SET_NUM_THREADS(1)


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux); a no-op elsewhere."""
    if PARENT_DEATH_SIGNAL:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def before_thread_shutdown(function: Callable[[], None]) -> None:
    """Run ``function`` at exit, before ``concurrent.futures`` stops taking work.

    threading's exit hooks run in reverse order of registration, before atexit's;
    concurrent.futures registers its own when imported (above, before any call
    here), so ``function``, registered after it, runs before it.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(function)
    else:  # pragma: no cover - every supported Python has it
        atexit.register(function)
