"""What putting a resume on record costs (issue 29, part 3: at most 5% of the load).

Usage (from the repository root)::

    python bench/resume_check.py [--megabytes 384] [--layer 1024] [--repeats 7]

A model of ``--layer`` x ``--layer`` float32 layers (4 MiB at 1024) and its AdamW state (a third
and two thirds of ``--megabytes``) are saved once; each repeat then resumes as a loop does
(``ckptfmt.load``, then ``load_state_dict`` into a fresh model and optimizer) and runs
``ckptfmt.record_resume`` on them, warm (the chunks in the page cache: the load at its fastest).
Prints the median of the per-repeat ratios of the record's time to the resume's, with their range.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import console

import ckptfmt
from ckptfmt.metadata import resumes


def make(layers: int, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=384)
    parser.add_argument("--layer", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    layer_mib = args.layer * args.layer * 4 / 2**20
    layers = max(1, round(args.megabytes / (3 * layer_mib)))  # weights, and twice as many bytes of moments
    model, optimizer = make(layers, args.layer)
    model(torch.randn(2, args.layer)).sum().backward()
    optimizer.step()
    with tempfile.TemporaryDirectory() as folder:
        url = f"{folder}/run/step-1"
        ckptfmt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, url, step=1)
        ratios, loads, records = [], [], []
        for _ in range(args.repeats):
            fresh, fresh_optimizer = make(layers, args.layer)
            start = time.perf_counter()
            state = ckptfmt.load(url)
            fresh.load_state_dict(state["model"])
            fresh_optimizer.load_state_dict(state["optimizer"])
            loaded = time.perf_counter() - start
            start = time.perf_counter()
            record = ckptfmt.record_resume(url, {"model": fresh, "optimizer": fresh_optimizer})
            checked = time.perf_counter() - start
            assert record.restored, record.parts
            resumes.forget_resumes(resumes.pending_resumes())
            del state
            ratios.append(checked / loaded)
            loads.append(loaded)
            records.append(checked)
    console.print(f"{layers} layers of {layer_mib:g} MiB, {layers * 3 * layer_mib:g} MiB: resume "
                  f"(load + load_state_dict) {statistics.median(loads):.3f} s, "
                  f"record_resume {statistics.median(records):.3f} s; "
                  f"record / resume {statistics.median(ratios):.1%} (range {min(ratios):.1%} to {max(ratios):.1%}, "
                  f"{args.repeats} repeats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
