"""Pausing Python's cyclic garbage collector while ckptfmt builds many small objects that form no cycle.

A manifest parsed, a state encoded, a save's plan and tensor table: thousands of tuples, dicts and
records that live until the step is done. Left on, the collector rescans the growing heap again and
again (4x the time of a manifest's parse; a third of a save of 2,000 small tensors). Nothing is
collected late that matters: the pause lasts one such step, and reference counting still frees.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
#: Pauses in progress, in every thread; the collector is turned back on when the last one ends.
_depth = 0
#: Whether the collector was on when the first of them began (off: the caller's choice, kept).
_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block. Pauses may nest and overlap across threads: the
    collector comes back on when the last one ends, if it was on when the first began."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                _promote_young()
                gc.enable()


def _promote_young() -> None:
    """Move every object the collector tracks to its oldest generation, without scanning any.

    Objects made while the collector was paused are all in its youngest generation: left there, the first
    allocation after the pause would scan them all at once (hundreds of thousands after a save's stage,
    a tenth of a second or more), and again as they age. ``gc.freeze`` then ``gc.unfreeze`` moves them,
    as documented, to the permanent generation and back into the oldest; cyclic garbage among them waits
    for the next full collection. Skipped where the program froze objects of its own (``gc.freeze``
    before forking workers): unfreezing would undo that."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
