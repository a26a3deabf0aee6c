"""How many threads a whole load reads with."""

from __future__ import annotations

import os

#: Reads kept in flight at most by a whole load.
MAX_READ_THREADS = 16
#: Bytes to read that are worth one more thread beyond one per core.
BYTES_PER_THREAD = 64 * 2**20


def read_threads(total_bytes: int) -> int:
    """Threads for a load of ``total_bytes``: one per core, and up to ``MAX_READ_THREADS`` for a large one.

    More reads in flight pay off only when the disk is the limit (cold, 1 GiB: 16 threads 0.57-0.60 s,
    2 threads 0.63-0.73 s); when the bytes are in the page cache every thread's Python work contends
    for the interpreter (a 90 MB state of 99 tensors, warm: 16 threads 27-34 ms, 2 threads 15-17 ms).
    """
    return max(1, min(MAX_READ_THREADS, max(os.cpu_count() or 1, total_bytes // BYTES_PER_THREAD)))
