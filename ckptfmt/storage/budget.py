"""``ByteBudget``: bounds the bytes that reading or copying threads hold at once, whatever objects claim.

verify reads chunks on several threads, replicate copies them: each thread takes
its chunk's size from the budget before reading it and gives it back after, so
memory stays under the limit even when a repository holds chunks of gigabytes.
"""

from __future__ import annotations

import contextlib
import threading


class ByteBudget:
    """Lets threads hold at most ``limit`` bytes at once; a request larger than that waits to run alone."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.condition = threading.Condition()

    @contextlib.contextmanager
    def take(self, size: int):
        with self.condition:
            self.condition.wait_for(lambda: self.used == 0 or self.used + size <= self.limit)
            self.used += size
        try:
            yield
        finally:
            with self.condition:
                self.used -= size
                self.condition.notify_all()
