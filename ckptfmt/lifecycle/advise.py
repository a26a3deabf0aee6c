"""How often to checkpoint: the interval that minimises expected lost time, from a run's own metadata.

Notation: ``tau`` is the training time between checkpoints (the interval, in
seconds of compute), ``delta`` the stall a save costs the training loop (the
whole save when synchronous; only the staging copy, a ``stage`` phase, when
asynchronous), ``b`` the background write of an asynchronous save (0 when
synchronous) and ``M`` the job's mean time between failures.

The model (first order in ``(tau + delta) / M``, as Young's):

- failures form a Poisson process of rate 1/M, independent of checkpointing,
  equally likely at any moment, rarely more than one per interval;
- a save stalls training ``delta' = delta + max(0, b - tau)`` seconds: an
  asynchronous save still writing when the next one is due makes it wait;
  a segment of training plus its save lasts ``T = tau + delta'``;
- a failure ``t`` seconds into a segment loses the ``t`` seconds since the last
  durable checkpoint's state was taken, plus the whole previous segment while
  that checkpoint is still being written in the background (``t < b``); so
  ``E[lost] = T/2 + b`` per failure;
- overhead, time lost per second of training progress, is the stall plus the
  failures' loss: ``delta'/tau + E[lost]/M``. For ``b <= tau`` it is least at
  ``tau = sqrt(2 delta M)`` (Young): ``b`` adds a constant per failure and moves
  no optimum, except that an interval shorter than ``b`` only adds waiting, so
  the advice is never shorter than ``b``;
- restart time (relaunch, loading) costs the same per failure whatever the
  interval, so it is left out: it moves no optimum and is not in the metadata.
"""

from __future__ import annotations

import math
import numbers
import os
import statistics
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta

from ckptfmt._deprecation import renamed_arguments
from ckptfmt.errors import CheckpointError
from ckptfmt.format.manifest import Manifest, optional_fields_except
from ckptfmt.metadata.step_timer import decode_steps
from ckptfmt.repository.repository import Repository
from ckptfmt.tools.describe import SaveTiming, save_timing, step_times

#: The phase an asynchronous save records for its staging copy, the only part that blocks training.
STAGE_PHASE = "stage"
#: Manifest fields advise reads: save timing, and provenance to leave imports out.
_SKIPPED = optional_fields_except("timing", "provenance")


# -- the formulas ------------------------------------------------------------------------------
def young_interval(delta_s: float, mtbf_s: float) -> float:
    """Young's optimum checkpoint interval, ``sqrt(2 delta M)`` seconds of compute.

    J. W. Young, "A first order approximation to the optimum checkpoint
    interval", Communications of the ACM 17(9), 1974.
    """
    _check(delta_s, mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s)


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate of the optimum interval, seconds of compute.

    ``sqrt(2 delta M) * [1 + (1/3) sqrt(delta / 2M) + (1/9) (delta / 2M)] - delta``
    for ``delta < 2M``, else ``M``. It equals Young's to first order when
    ``delta << M`` and stays close to the exact optimum of the exponential
    failure model as ``delta`` nears ``M``. Restart time does not enter it.

    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
    restart dumps", Future Generation Computer Systems 22(3), 2006.
    """
    _check(delta_s, mtbf_s)
    if delta_s >= 2.0 * mtbf_s:
        return float(mtbf_s)
    ratio = delta_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - delta_s


def expected_lost_work(interval_s: float, delta_s: float, background_s: float = 0.0) -> float:
    """Expected seconds of work one failure loses: ``T/2 + b``, ``T = tau + delta'`` (module docstring)."""
    _check(delta_s, background_s=background_s, interval_s=interval_s)
    return (interval_s + _stall(interval_s, delta_s, background_s)) / 2.0 + background_s


def expected_overhead(interval_s: float, delta_s: float, mtbf_s: float, background_s: float = 0.0) -> float:
    """Expected time lost per second of training progress (0.05: 5 %): ``delta'/tau + E[lost]/M``.

    For a synchronous save (``b = 0``) that is Young's ``delta/tau + (tau + delta)/2M``.
    """
    _check(delta_s, mtbf_s, background_s, interval_s)
    return (_stall(interval_s, delta_s, background_s) / interval_s
            + expected_lost_work(interval_s, delta_s, background_s) / mtbf_s)


def auto_interval(stall_s: float, step_s: float, mtbf_s: float, background_s: float = 0.0) -> int:
    """Save every how many steps (>= 1): Daly's interval in steps of ``step_s`` seconds, never shorter
    than the background write (a shorter one only makes the next save wait for it).

    For a manager's ``interval="auto"``: pass the measured stall of a save
    (its blocking part when asynchronous), the median step time, the job's MTBF
    and an asynchronous save's background time, all in seconds.
    """
    _check(stall_s, mtbf_s, background_s)
    if not (isinstance(step_s, numbers.Real) and step_s > 0 and math.isfinite(step_s)):
        raise ValueError(f"the step time must be a positive number of seconds, not {step_s!r}")
    return _steps(daly_interval(stall_s, mtbf_s), step_s, background_s)


def _steps(interval_s: float, step_s: float, background_s: float) -> int:
    """An interval as whole steps, at least one and at least the background write's."""
    return max(1, round(interval_s / step_s), math.ceil(background_s / step_s))


def _stall(interval_s: float, delta_s: float, background_s: float) -> float:
    """What a save blocks training for: its stall, plus the wait for a previous save still writing."""
    return delta_s + max(0.0, background_s - interval_s)


def _check(delta_s: float, mtbf_s: float | None = None, background_s: float = 0.0,
           interval_s: float | None = None) -> None:
    """Refuse what is not a finite number of seconds: negative stalls, zero intervals and MTBFs."""
    checks = (("save stall", delta_s, "non-negative"), ("background time", background_s, "non-negative"),
              ("MTBF", mtbf_s, "positive"), ("checkpoint interval", interval_s, "positive"))
    for what, value, kind in checks:
        if value is None and kind == "positive":  # optional
            continue
        if (not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value)
                or not (value >= 0 if kind == "non-negative" else value > 0)):
            raise ValueError(f"the {what} must be a {kind} number of seconds, not {value!r}")


# -- the advice for a repository ---------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Checkpointing every ``steps`` steps (``interval_s`` seconds of training), and what it costs."""

    steps: int
    interval_s: float
    #: Expected time lost per second of training progress (0.05: 5 %).
    overhead: float
    #: Expected seconds of work lost per failure.
    lost_per_failure_s: float


@dataclass(frozen=True)
class Advice:
    """The measured save costs and step time of a run, and the actual, Young and Daly intervals."""

    repo: str
    mtbf_s: float
    #: Checkpoints whose save timing was measured (of them, asynchronous ones).
    saves: int
    asynchronous: int
    #: Median blocking stall per save, and median background write of the asynchronous saves.
    stall_s: float
    background_s: float
    #: Median step time and where it came from: "step records", "step_times" or "checkpoint spacing".
    step_s: float
    step_source: str
    actual: Plan
    young: Plan
    #: Daly's interval: the recommendation.
    daly: Plan

    @property
    def checkpoints_ratio(self) -> float:
        """Checkpoints the advice takes per checkpoint the run took (2.0: twice as many)."""
        return self.actual.interval_s / self.daly.interval_s

    def to_dict(self) -> dict:
        return {**asdict(self), "checkpoints_ratio": self.checkpoints_ratio}


@renamed_arguments(repo_url="repo", mtbf_s="mtbf")
def advise(repo: str | os.PathLike, *, mtbf: timedelta | float, storage_options: dict | None = None) -> Advice:
    """The checkpoint interval for the run in repository ``repo`` (a URL), from its checkpoints' own timing
    (spec 9.4); ``mtbf``: the mean time between failures, a timedelta or seconds.

    Needs two checkpoints saved by training (imports are left out: their timing
    is the import's) with step numbers, and save timing in at least one.
    """
    mtbf_s = mtbf.total_seconds() if isinstance(mtbf, timedelta) else mtbf
    _check(0.0, mtbf_s)  # a number of seconds: a string or a bool is refused
    run = Repository.open(repo, storage_options)
    manifests = _manifests(run)
    saves = [m for m in manifests if not _imported(m)]
    if len(saves) < 2:
        imported = f" and {len(manifests) - len(saves)} imported" if len(manifests) > len(saves) else ""
        raise CheckpointError(f"{run.url}: {len(saves)} checkpoint(s) saved by training{imported}; advice "
                              "needs at least 2, to measure the interval between them")
    stalls = [split for split in (_save_split(m) for m in saves) if split is not None]
    if not stalls:
        raise CheckpointError(f"{run.url}: no checkpoint records its save timing (timing.ranks, spec 9.4): "
                              "nothing to measure the save stall from")
    stall = statistics.median(s for s, _, _ in stalls)
    backgrounds = [b for _, b, is_async in stalls if is_async]
    background = statistics.median(backgrounds) if backgrounds else 0.0
    steps, spacings = _intervals(run.url, saves)
    step_s, source = _step_time(run.url, saves, spacings, stall)

    def plan(count: int) -> Plan:
        interval = count * step_s
        return Plan(count, interval, expected_overhead(interval, stall, mtbf_s, background),
                    expected_lost_work(interval, stall, background))
    return Advice(
        repo=run.url, mtbf_s=float(mtbf_s), saves=len(stalls), asynchronous=len(backgrounds), stall_s=stall,
        background_s=background, step_s=step_s, step_source=source, actual=plan(steps),
        young=plan(_steps(young_interval(stall, mtbf_s), step_s, background)),
        daly=plan(auto_interval(stall, step_s, mtbf_s, background)),
    )


def _manifests(repo: Repository) -> list[Manifest]:
    """Every committed checkpoint's manifest, oldest first, read 8 at a time (remote storage)."""
    records = repo.commits()
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="ckptfmt-advise") as pool:
        return list(pool.map(lambda r: repo.manifest(r.name, r, skip=_SKIPPED), records))


def _imported(manifest: Manifest) -> bool:
    """Converted by ``ckptfmt import`` (spec 9.6); a DCP save also has provenance but is training's."""
    provenance = manifest.provenance
    return isinstance(provenance, Mapping) and provenance.get("source_kind") != "dcp"


def _save_split(manifest: Manifest) -> tuple[float, float, bool] | None:
    """(blocking stall, background time, asynchronous?) of one save: the slowest rank's of each, since
    training waits for every rank; None when the checkpoint records no save timing."""
    splits = [split for r in save_timing({"timing": manifest.timing}) if (split := rank_split(r)) is not None]
    if not splits:
        return None
    return max(s[0] for s in splits), max(s[1] for s in splits), any(s[2] for s in splits)


def rank_split(timing: SaveTiming) -> tuple[float, float, bool] | None:
    """(blocking, background, asynchronous?) seconds of one rank's save: an asynchronous save's
    ``stage`` phases block and the rest run in the background; a synchronous save blocks throughout
    (``total_s``, or its phases' sum without one). None when it records no durations."""
    staged = [d for name, d in timing.phases if name == STAGE_PHASE]
    if staged:
        return sum(staged), sum(d for name, d in timing.phases if name != STAGE_PHASE), True
    if timing.total_s is not None:
        return timing.total_s, 0.0, False
    return (sum(d for _, d in timing.phases), 0.0, False) if timing.phases else None


def _intervals(where: str, saves: list[Manifest]) -> tuple[int, list[tuple[int, float]]]:
    """The run's median interval in steps, and the (steps, seconds) between each two consecutive
    checkpoints with step numbers (a step going back, a restart from an earlier checkpoint, is no interval)."""
    stepped = [(m.step, m.created_ns) for m in saves if m.step is not None]
    pairs = [(b_step - a_step, (b_ns - a_ns) / 1e9) for (a_step, a_ns), (b_step, b_ns) in zip(stepped, stepped[1:])
             if b_step > a_step]
    if not pairs:
        raise CheckpointError(
            f"{where}: advice needs two checkpoints saved by training with increasing step numbers "
            f"(save(..., step=N)); found {len(saves)} saved by training, {len(stepped)} of them with a step")
    return round(statistics.median(p[0] for p in pairs)), pairs


def _step_time(where: str, saves: list[Manifest], spacings: list[tuple[int, float]],
               stall: float) -> tuple[float, str]:
    """The median step time: from StepTimer records, else the caller's ``step_times``, else the time
    between consecutive checkpoints less the save's stall, per step."""
    durations = [float(d) for m in saves for place, record in _step_records(m)
                 for d in decode_steps(record, place).duration_s]
    if durations:
        return statistics.median(durations), "step records"
    given = [t for m in saves for t in step_times({"timing": m.timing}) if t > 0]
    if given:
        return statistics.median(given), "step_times"
    step_s = statistics.median((seconds - stall) / steps for steps, seconds in spacings)
    if not step_s > 0:
        raise CheckpointError(f"{where}: the checkpoints record no step times "
                              "(StepTimer or step_times), and their spacing is no longer than a save: "
                              "no step time to measure")
    return step_s, "checkpoint spacing"


def _step_records(manifest: Manifest) -> list[tuple[str, object]]:
    """(where, stored StepTimer record) of each rank of a checkpoint that has one (spec 9.4)."""
    ranks = manifest.timing.get("ranks") if isinstance(manifest.timing, Mapping) else None
    if not isinstance(ranks, list):
        return []
    return [(f"checkpoint {manifest.name!r} timing.ranks[{i}].steps", rank["steps"])
            for i, rank in enumerate(ranks) if isinstance(rank, Mapping) and "steps" in rank]
