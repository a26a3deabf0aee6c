"""What ckptfmt.StepTimer costs a training loop: microseconds per phase, per step and per batch digest.

Usage (from the repository root)::

    python bench/step_timer.py [--steps 20000]

Times, in one process, empty steps holding 4 empty phases, against the same
loop without the timer; a phase's cost is the difference divided by 4. Also the
cost of ``batch()`` with 256 indices (a tensor) and of ``metrics(loss=...)``.
Prints the median of 5 runs of each.

Then what the system sampler (``system_interval``, 1 s by default) takes from the
training thread: empty steps (about ``--sampling-s`` seconds of them) of a timer
that samples beside them and of one that does not, alternated over 9 pairs, the
median of the per-step differences; and one sample's time, which is what the
sampling thread holds the GIL for each second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import console

import ckptfmt
from ckptfmt.metadata.system import SystemSampler

PHASES = ("data", "forward", "backward", "optimizer")


def bare(steps: int) -> float:
    start = time.perf_counter()
    for _step in range(steps):
        for _ in PHASES:
            pass
    return time.perf_counter() - start


def timed(steps: int, indices: torch.Tensor | None = None, metrics: bool = False) -> float:
    timer = ckptfmt.StepTimer(rng=False)  # the timing alone: bench/step_signature.py measures the digests
    start = time.perf_counter()
    for step in range(steps):
        with timer.step(step):
            if indices is not None:
                timer.batch(indices)
            for name in PHASES:
                with timer.phase(name):
                    pass
        if metrics:
            timer.metrics(loss=0.5)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--sampling-s", type=float, default=10.0, help="seconds of busy steps per sampling run")
    args = parser.parse_args()
    n = args.steps
    indices = torch.arange(256)

    def median_us(run) -> float:
        return statistics.median(run() for _ in range(5)) / n * 1e6

    base = median_us(lambda: bare(n))
    steps_only = median_us(lambda: timed(n))
    with_batch = median_us(lambda: timed(n, indices))
    with_metrics = median_us(lambda: timed(n, metrics=True))
    console.print(f"step with 4 phases: {steps_only - base:.2f} us, i.e. {(steps_only - base) / 4:.2f} us per phase "
                  f"(the step's own share included)")
    console.print(f"batch(256 indices, tensor): {with_batch - steps_only:.2f} us")
    console.print(f"metrics(loss=...): {with_metrics - steps_only:.2f} us")
    sampling(args.sampling_s)
    return 0


def timed_steps(steps: int, interval) -> float:
    """Seconds for ``steps`` empty steps of a timer sampling every ``interval`` (None: not at all)."""
    timer = ckptfmt.StepTimer(system_interval=interval)
    start = time.perf_counter()
    for step in range(steps):
        with timer.step(step):
            pass
    elapsed = time.perf_counter() - start
    timer.close()
    return elapsed


def sampling(seconds: float) -> None:
    """The sampler's cost to the training thread, two ways: per empty step, sampling every second beside
    steps as short as they come (what the thread pays per step, the sampling thread's turns on the GIL
    included), alternated with steps of a timer that does not sample; and one sample's time, the GIL
    time the sampling thread takes per second."""
    steps = max(1000, int(seconds * 100_000))
    differences = []
    for pair in range(9):
        times = {}
        for interval in ((1.0, None) if pair % 2 else (None, 1.0)):
            times[interval] = timed_steps(steps, interval)
        differences.append((times[1.0] - times[None]) / steps * 1e6)
    sampler = SystemSampler(None)
    costs = []
    for _ in range(50):
        start = time.perf_counter()
        sampler.sample()
        costs.append(time.perf_counter() - start)
    console.print(f"system sampling every 1 s, per empty step: {statistics.median(differences):.3f} us (median of "
                  f"9 pairs of {steps} steps; range {min(differences):.3f} to {max(differences):.3f})")
    console.print(f"one sample: {statistics.median(costs) * 1e6:.0f} us, so the sampling thread holds the GIL "
                  f"about {statistics.median(costs) * 1e2:.3f}% of the time at one sample a second")


if __name__ == "__main__":
    sys.exit(main())
