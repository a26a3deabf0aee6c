"""Each rank's own record of a save, for the coordinator's manifest (spec 9): what the save call
captured (``Captured``), the rank's RNG states, environment, topology entry and timing (``rank_record``),
and the timing entry of a rank that wrote nothing but sent its training steps (``steps_record``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptfmt.metadata.environment import capture_environment
from ckptfmt.metadata.rng import rng_entry
from ckptfmt.metadata.timing import PhaseTimer, with_steps


@dataclass(frozen=True)
class Captured:
    """What a save call captured when it was made, for a save that may run later (``async_save``).

    ``steps``: the StepTimer's step records not yet stored (``StepTimer.snapshot``), or None;
    ``rng``: this process's generator states at the call (``capture_states``), or None for the
    states when the record is made; ``staged``: (start_ns, duration_s) of the staging copy, the
    save's ``stage`` phase; ``frozen``: the state is staged memory that nothing changes until the
    save ends; ``device_stats``: staged tensor (``staging.memory_key``) -> its statistics, taken
    on its CUDA device while it was staged.
    """

    steps: dict | None = None
    rng: dict | None = None
    #: This process's resumes not yet stored (``metadata.resumes``), put in its rank's timing entry.
    resumes: list[dict] | None = None
    staged: tuple[int, float] | None = None
    frozen: bool = False
    device_stats: dict[tuple, dict] | None = None


def rank_record(rank: int, timer: PhaseTimer, topology: dict, captured: Captured) -> dict:
    """This rank's own record for the manifest: its RNG states, environment (phase ``environment``),
    ``topology.ranks`` entry and ``timing.ranks`` entry (spec 9)."""
    with timer.phase("environment"):
        environment = capture_environment()
    return {"rng": rng_entry(rank, captured.rng), "environment": environment, "topology": topology,
            "timing": timer.record(rank, captured.steps, captured.resumes)}


def steps_record(entry: dict, start_ns: int) -> dict:
    """The ``timing.ranks`` entry of a rank that wrote nothing but sent its training steps (a gathered
    entry, see ``SaveOptions.gathered_steps``): no phases, no time in the save (spec 9.4)."""
    return with_steps({"rank": entry["rank"], "host": entry["host"], "start_ns": start_ns, "phases": [],
                       "total_s": 0.0}, entry["steps"], entry.get("resumes"))
