"""What ckptfmt.StepTimer costs a training loop: microseconds per phase, per step and per batch digest.

Usage (from the repository root)::

    python bench/step_timer.py [--steps 20000]

Times, in one process, empty steps holding 4 empty phases, against the same
loop without the timer; a phase's cost is the difference divided by 4. Also the
cost of ``batch()`` with 256 indices (a tensor) and of ``metrics(loss=...)``.
Prints the median of 5 runs of each.
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

PHASES = ("data", "forward", "backward", "optimizer")


def bare(steps: int) -> float:
    start = time.perf_counter()
    for _step in range(steps):
        for _ in PHASES:
            pass
    return time.perf_counter() - start


def timed(steps: int, indices: torch.Tensor | None = None, metrics: bool = False) -> float:
    timer = ckptfmt.StepTimer()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
