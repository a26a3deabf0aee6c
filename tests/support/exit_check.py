"""Make a rare abort at exit a certain failure: report gloo threads still running when a rank exits.

A gloo process group that is still alive when the interpreter shuts down keeps its worker threads;
one that is still releasing a collective's work then needs the GIL during ``Py_FinalizeEx`` and
aborts the process ("terminate called without an active exception"), a few runs in a hundred on a
busy machine. Every group that is released before then has joined its threads, so a rank whose
groups are all gone at exit cannot abort this way. ``report_gloo_threads_at_exit()``, called in a
launched test program, prints ``GLOO_THREADS_AT_EXIT`` on stderr when some remain at exit (after
ckptfmt's own exit hook, which destroys its side groups), and the launching test fails on that
line: every run, not one in thirty.

The DeepSpeed programs use it (tests/support/deepspeed_teardown.py releases what DeepSpeed keeps).
Elsewhere torch itself keeps the default group to the end: DTensor's redistribute planner cache
holds every DeviceMesh an FSDP2 model used, and Lightning and the Trainer never destroy their
groups. Such a group is idle at exit unless a worker thread is still freeing the last collective
(a barrier right after FSDP2's all-gathers: tests/scripts/torchtitan_manager.py aborted so 1 run in
25); ckptfmt's exit hook destroys its own groups, collects reference cycles and lets go of the GIL
for a moment so that such a worker finishes first (ckptfmt/groups/process_group.py).
"""

from __future__ import annotations

import atexit
import os
import sys

MARKER = "GLOO_THREADS_AT_EXIT"
_GLOO_THREAD_NAMES = ("pt_gloo_runloop", "gloo_tcp_loop")


def gloo_threads() -> list[str]:
    """The names of this process's native gloo threads (Linux: /proc/self/task)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="ascii") as comm:
                name = comm.read().strip()
        except OSError:  # the thread ended while listed
            continue
        if name.startswith(_GLOO_THREAD_NAMES):
            names.append(name)
    return sorted(names)


def _report() -> None:
    side_groups = sys.modules.get("ckptfmt.groups.process_group")
    if side_groups is not None:  # its exit hook may run after this one; it is idempotent
        side_groups.release_side_groups()
    remaining = gloo_threads()
    if remaining:
        print(f"{MARKER}: {len(remaining)} gloo threads still run (a process group outlives "
              f"destroy_process_group): {', '.join(remaining)}", file=sys.stderr, flush=True)


def report_gloo_threads_at_exit() -> None:
    """Check this process's gloo threads when it exits."""
    if sys.platform.startswith("linux"):
        atexit.register(_report)
