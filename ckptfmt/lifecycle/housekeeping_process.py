"""Replication to the next tiers in a child process of its own, stopped while the training loop saves.

The copies run in a child process at the lowest CPU priority, which the
manager stops (SIGSTOP) from the moment a save starts until it has committed,
then lets go on (SIGCONT); retention and garbage collection stay on the
manager's thread. The child is ``python -c "...main(sys.argv)" FD PID``, not a
multiprocessing worker; the kernel kills it when the thread that started it
ends (PR_SET_PDEATHSIG: Linux only, hence process mode only there), and it
ends when the manager closes. Why each of these: docs/design/replication-child.md.
Messages
(``multiprocessing.connection`` framing):

    manager -> child   ("start", tiers), then ("replicate", metrics) per run, ("stop", None) last
    child -> manager   ("done", (problems, warned)) | ("failed", exception), one per run

where ``warned`` is the warnings the run raised, as (message, category): the
manager raises them again, so that its own warning filters and handlers (a
logger, pytest) see them rather than the child's stderr.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
import warnings
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ckptfmt._platform import PARENT_DEATH_SIGNAL, die_with_parent
from ckptfmt.lifecycle.housekeeping import Housekeeper, Tier

#: Whether process mode is available: it needs the kernel to end an orphaned, possibly stopped child.
SUPPORTED = PARENT_DEATH_SIGNAL
#: The child's nice value: the highest, so that it runs on what the training loop leaves.
CHILD_NICE = 19
#: How long ``close`` waits for the child to go before killing it.
CLOSE_TIMEOUT_S = 30.0
#: The folder this package was imported from: the child imports the same one.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[__name__.count(".")])  # the folder holding ckptfmt/
#: The child's program (not ``-m``: the package imports this module before runpy would run it). The
#: package's folder goes first on its path unless it is there already (site-packages stays after the
#: standard library).
_CHILD = (f"import sys; root = {_PACKAGE_ROOT!r}; root in sys.path or sys.path.insert(0, root); "
          f"from {__name__} import main; main(sys.argv)")


class HousekeepingProcess(Housekeeper):
    """A Housekeeper whose copies run in a child process (started by the first run), stopped while paused.

    ``pause`` and ``resume`` come from the training loop and the save's
    thread, runs from the manager's thread. A child that died is reported by
    the run that finds it, as a problem; the next run starts another.
    """

    def __init__(self, tiers: list[Tier], gc_wait_s: float, *, drained: bool = False):
        super().__init__(tiers, gc_wait_s, drained=drained)
        self._lock = threading.Lock()
        self._paused = False
        self._child: subprocess.Popen | None = None
        self._connection: Connection | None = None
        #: Whether the child has said it dies with this process: it is stopped only from then on.
        self._armed = False

    @property
    def pid(self) -> int | None:
        """The child's process id, None while none runs."""
        return None if self._child is None else self._child.pid

    def pause(self) -> None:
        with self._lock:
            self._paused = True
            self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._signal(signal.SIGCONT)

    def replicate(self, metrics: dict[str, dict]) -> list[str]:
        self._metrics.update(metrics)  # for retention, here
        with self._lock:
            connection = self._connection if self._connection is not None else self._start()
        try:
            if not self._armed:
                self._wait_until_armed(connection)
            connection.send(("replicate", metrics))
            outcome, payload = connection.recv()
        except (EOFError, OSError):
            status = self._stop()
            return [f"the replication process ended (exit status {status}); a new one takes over after the "
                    "next save"]
        if outcome == "failed":
            raise payload
        problems, warned = payload
        for message, category in warned:
            warnings.warn(f"checkpoint manager's replication process: {message}", category, stacklevel=2)
        return problems

    def close(self) -> None:
        self._stop()

    def _start(self) -> Connection:
        """Start the child (under the lock), stopped at once if a save is running; the connection to it."""
        ours, theirs = socket.socketpair()
        with theirs:
            self._child = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                start_new_session=True)  # the terminal's Ctrl-C is the manager's to handle
        connection = self._connection = Connection(ours.detach())
        self._armed = False
        connection.send(("start", (self.tiers, self.drained)))
        return connection

    def _wait_until_armed(self, connection: Connection) -> None:
        """Wait for the child's word that the kernel kills it when this process dies, then stop it if
        a save runs. Stopped before that, it would never die: a child killed with its parent while
        starting up stayed stopped for good, holding its parent's stdout and stderr open."""
        kind, _ = connection.recv()
        if kind != "armed":
            raise RuntimeError(f"the replication process said {kind!r} before it was ready")
        with self._lock:
            self._armed = True
            if self._paused:
                self._signal(signal.SIGSTOP)

    def _signal(self, signum: int) -> None:
        if self._child is not None and (self._armed or signum != signal.SIGSTOP):
            self._child.send_signal(signum)  # does nothing once the child has been reaped

    def _stop(self) -> int | None:
        """Tell the child to end and reap it; its exit status."""
        with self._lock:
            connection, child = self._connection, self._child
            self._connection = self._child = None
        if child is None or connection is None:
            return None
        try:
            connection.send(("stop", None))
        except OSError:  # it has ended already
            pass
        connection.close()
        child.send_signal(signal.SIGCONT)  # a stopped child cannot read it
        try:
            return child.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            return child.wait()


def _serve(connection: Connection) -> None:
    """The child: the runs it is sent, in order, until told to stop (or the manager's end closes)."""
    _, (tiers, drained) = connection.recv()
    keeper = Housekeeper(tiers, gc_wait_s=0.0, drained=drained)
    while True:
        try:
            kind, metrics = connection.recv()
        except (EOFError, OSError):
            return
        if kind == "stop":
            return
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")  # the manager's filters decide
                problems = keeper.replicate(metrics)
            reply: tuple[str, Any] = ("done", (problems, [(str(w.message), _portable_category(w.category))
                                                          for w in caught]))
        except Exception as exc:
            reply = ("failed", _portable(exc))
        try:
            connection.send(reply)
        except OSError:
            return


def _portable(exc: Exception) -> Exception:
    """``exc`` with the child's traceback as a note, or a RuntimeError saying the same if it cannot be pickled."""
    where = "".join(traceback.format_exception(exc))
    exc.add_note(f"in the checkpoint manager's replication process:\n{where}")
    return exc if _survives_pickling(exc) else RuntimeError(
        f"the checkpoint manager's replication process failed:\n{where}")


def _portable_category(category: type[Warning]) -> type[Warning]:
    """``category``, or UserWarning where the manager could not unpickle it (a class it cannot import)."""
    return category if _survives_pickling(category) else UserWarning


def _survives_pickling(value: object) -> bool:
    """Whether ``value`` pickles and unpickles here, as the manager will need to."""
    try:
        pickle.loads(pickle.dumps(value))
        return True
    except Exception:
        return False


def main(argv: list[str]) -> None:
    fd, manager_pid = int(argv[1]), int(argv[2])
    die_with_parent()
    if os.getppid() != manager_pid:  # the manager died before the line above
        return
    try:
        os.nice(CHILD_NICE)  # before any thread starts: every thread of the child inherits it
    except OSError:  # a sandbox may forbid it: the child then merely competes
        pass
    connection = Connection(fd)
    try:
        connection.send(("armed", None))  # the manager may stop this process from now on
    except OSError:  # the manager has gone
        return
    _serve(connection)

