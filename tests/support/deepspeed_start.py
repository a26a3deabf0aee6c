"""Start DeepSpeed's distributed backend in a test program without compiling anything.

On the CPU accelerator, ``deepspeed.init_distributed`` JIT-compiles a shared-memory all-reduce
(the ``deepspeed_shm_comm`` op, an inference speed-up) through ``torch.utils.cpp_extension``:
50 to 100 s of the 2 test cores on a fresh machine, under a lock file in ~/.cache/torch_extensions
that every later launch waits on, forever, once a launch was killed while holding it (how CI hung
for 300 s at the first DeepSpeed launch). Marking the op incompatible makes DeepSpeed use plain
gloo collectives, which the tests need; DeepSpeed caches the compatibility table in
``deepspeed.ops``, so the edit holds for the process.
"""

from __future__ import annotations

import deepspeed


def init_distributed() -> None:
    """``deepspeed.init_distributed`` on gloo, with the shared-memory op left unbuilt."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
