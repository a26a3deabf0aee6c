"""What signing every step costs a training loop (issue 29, part 2: at most 20 us per step on the CPU).

Usage (from the repository root)::

    python bench/step_signature.py [--steps 20000] [--pairs 9]

A signed step is ``with timer.step(n)``, ``timer.batch(indices)`` and ``timer.metrics(loss=...)``
with the timer's generator digests on (torch's CPU generator, numpy's and Python's: what the timer
digests on a machine without CUDA), against the same loop with ``StepTimer(rng=False)``; pairs
of runs with their order alternated, the median of the per-pair differences per step and their
range. Also the whole step record's cost against a bare loop, and ``batch_tensors`` of a batch
of 32 x 128 float32 inputs and 32 int64 labels (16.5 KB), the digest a framework's hook takes
where the loop's sample indices are out of its sight. And the output signature the integrations' step
hooks take where no hook sees the loss (Accelerate, torchtitan): ``grad_norm_local``, one norm over
the gradients a step, per step on a small MLP and, on a 24M-parameter model, against the gradient
clipping such loops already do (``clip_grad_norm_``).
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
from ckptfmt.integrations.step_hooks import local_gradient_norm


def loop(steps: int, timer: ckptfmt.StepTimer | None, batch=None) -> float:
    """Seconds for ``steps`` steps that each draw nothing and do nothing but be recorded."""
    indices = torch.arange(256)
    loss = 0.25
    start = time.perf_counter()
    if timer is None:
        for _step in range(steps):
            pass
    else:
        for step in range(steps):
            with timer.step(step):
                if batch is None:
                    timer.batch(indices)
                else:
                    timer.batch_tensors(batch)
            timer.metrics(loss=loss)
    elapsed = time.perf_counter() - start
    if timer is not None:
        timer.close()
    return elapsed


def paired(steps: int, pairs: int, first, second) -> list[float]:
    """Per-step differences (us) of ``second`` over ``first``, each pair run in alternated order."""
    differences = []
    for pair in range(pairs):
        times = {}
        for which in ((0, 1) if pair % 2 == 0 else (1, 0)):
            times[which] = (first, second)[which]()
        differences.append((times[1] - times[0]) / steps * 1e6)
    return differences


def gradient_signature(widths: list[int], calls: int, pairs: int) -> tuple[list[float], list[float]]:
    """Per call (us) of ``local_gradient_norm`` over an MLP of ``widths`` with every gradient set, and its
    ratio to ``clip_grad_norm_`` of the same gradients, pairs of ``calls`` calls in alternated order."""
    layers = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    model = torch.nn.Sequential(*layers)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def timed(work) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            work()
        return time.perf_counter() - start

    ours, ratios = [], []
    for pair in range(pairs):
        times = {}
        for which in ((0, 1) if pair % 2 == 0 else (1, 0)):
            times[which] = timed((lambda: local_gradient_norm([optimizer]),
                                  lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))[which])
        ours.append(times[0] / calls * 1e6)
        ratios.append(times[0] / times[1])
    return ours, ratios


def summary(differences: list[float]) -> str:
    return f"{statistics.median(differences):.2f} us (range {min(differences):.2f} to {max(differences):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--pairs", type=int, default=9)
    args = parser.parse_args()
    n, pairs = args.steps, args.pairs

    def unsigned() -> float:
        return loop(n, ckptfmt.StepTimer(system_interval=None, rng=False))

    def signed() -> float:
        return loop(n, ckptfmt.StepTimer(system_interval=None))

    batch = {"x": torch.randn(32, 128), "y": torch.zeros(32, dtype=torch.long)}
    signature = paired(n, pairs, unsigned, signed)
    whole = paired(n, pairs, lambda: loop(n, None), signed)
    tensors = paired(n, pairs, unsigned,
                     lambda: loop(n, ckptfmt.StepTimer(system_interval=None, rng=False), batch))
    console.print(f"generator digests (torch, numpy, python) per step: {summary(signature)}; median of {pairs} "
                  f"pairs of {n} steps")
    console.print(f"a whole signed step record (step, 256 indices, loss, digests) over a bare loop: {summary(whole)}")
    console.print(f"batch_tensors of 16.5 KB instead of batch(256 indices): {summary(tensors)}")
    small, _ = gradient_signature([128, 64, 64, 1], 2000, pairs)
    console.print(f"the hooks' gradient signature (grad_norm_local), a 12K-parameter MLP: {summary(small)} a step")
    large, ratios = gradient_signature([2048] * 7, 20, pairs)
    console.print(f"the same, 25M parameters: {statistics.median(large) / 1000:.2f} ms a step, "
                  f"{statistics.median(ratios):.2f}x clip_grad_norm_ of the same gradients "
                  f"(range {min(ratios):.2f} to {max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
