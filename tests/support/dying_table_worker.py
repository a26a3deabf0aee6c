"""A table child (``ckptfmt.analytics.processes``) killed by a signal before it writes anything: what
the caller says then (tests/analytics/test_analytics_processes.py)."""

import os
import signal


def main(fd: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)
