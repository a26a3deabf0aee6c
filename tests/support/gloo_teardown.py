"""End a test program that ran gloo collectives the way ckptfmt's exit handler ends its own groups.

``groups.process_group.release_side_groups`` collects, destroys the groups and lets go of the
interpreter for a moment, so that a gloo thread still freeing the last collective's work gets it
before the interpreter shuts down. A program that loads no module registering that handler (one
that only loads) does the same here: hosts_restore.py once aborted at exit without it ("terminate
called without an active exception").
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch.distributed as dist


def run_then_tear_down(main: Callable[[], None]) -> None:
    """``main()``, its tensors and meshes freed with its frame, then the group destroyed and a 50 ms pause."""
    main()
    gc.collect()
    dist.destroy_process_group()
    time.sleep(0.05)
