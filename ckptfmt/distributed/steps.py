"""Every rank's training steps, gathered for a save that one rank makes.

Frameworks such as Lightning write a checkpoint from rank 0 alone, yet the
analytics need every rank's step records (stragglers are found by comparing
ranks). ``gather_steps`` runs on every rank at the moment the framework
prepares its checkpoint (a collective: every rank calls it) and hands rank 0
what ``ckptfmt.save(..., gathered_steps=)`` stores as each rank's (spec 9.4).
"""

from __future__ import annotations

import socket
from typing import Any

from ckptfmt.groups.process_group import RankGroup, distributed_group
from ckptfmt.metadata.resumes import forget_resumes, pending_resumes
from ckptfmt.metadata.step_timer import StepTimer
from ckptfmt.metadata.topology import current_rank
from ckptfmt.saving.options import DEFAULT_TIMEOUT_S


def gather_steps(timer: StepTimer, *, process_group: Any = None, timeout: float = DEFAULT_TIMEOUT_S
                 ) -> list[dict] | None:
    """This rank's unstored steps and every other rank's, on rank 0 of the group (None on the others).

    Each entry is ``{"rank", "host", "steps"}``. Every rank's timer forgets the
    steps it sent: the save that rank 0 makes is the only one that will hold
    them (if it fails, they are lost rather than stored twice). Without a
    process group of more than one rank, only this process's steps.
    """
    group = distributed_group(process_group)
    ranks = None if group is None else RankGroup(group, timeout, "gathering the training steps")
    steps = timer.snapshot()
    resumes = pending_resumes()
    own = {"rank": current_rank()[0] if ranks is None else ranks.rank, "host": socket.gethostname(), "steps": steps,
           **({"resumes": resumes} if resumes else {})}
    gathered = [own] if ranks is None else ranks.gather(own)
    timer.forget_stored(steps)
    forget_resumes(resumes)
    return gathered
