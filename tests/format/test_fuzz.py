"""A quick subset of the structure-aware fuzzing of tests/support/fuzz_inputs.py (the whole run is ``make fuzz``).

200 mutated manifests, commit records and markers, each read by open, load,
restore_rng, verify, diff, show and ls: nothing but CheckpointError subclasses,
each case within its time and memory bounds.
"""

from __future__ import annotations

import io
import time

import pytest
import torch
from rich.console import Console

import ckptfmt
from ckptfmt.cli import build_parser
from tests.support import fuzz_inputs


@pytest.mark.slow
def test_quick_subset_of_fuzzed_inputs():
    cases = fuzz_inputs.run(range(200), seed=1)
    report = fuzz_inputs.summary(cases)
    failures = [failure for case in cases for failure in case.failures]
    assert not failures, f"{len(failures)} reads broke the contract; the first:\n{failures[0]}"
    assert report["over_time"] == [] and report["over_memory"] == [], report
    # The fuzzer really exercised the readers: every target and kind of mutation, refusals and successes.
    assert set(report["by_target"]) == {"manifest", "commit", "marker", "chunk"}
    assert {"swap-type", "inflate-count", "duplicate-key", "deep-nesting", "damage-bytes",
            "plane-length"} <= set(report["mutations"])
    outcomes = report["outcomes"]
    assert outcomes.get("load: ok", 0) > 20 and outcomes.get("load: ManifestError", 0) > 100, outcomes


def test_show_json_of_a_very_long_document_stays_within_a_cases_bounds(tmp_path):
    """Once case 6773 of seed 1 (two swapped types and an inflated count): ``show --json`` printed its
    126,000 lines through rich's JSON highlighter, 1.9-2.4 s of CPU and 120 MiB against the bounds of
    1 s and 256 MiB. Built directly here: a case number names another input whenever the corpus changes
    (its checkpoints record the machine's environment, every installed package included)."""
    url = str(tmp_path / "repo" / "long")
    ckptfmt.save({"w": torch.ones(2)}, url, metadata={"history": list(range(126_000))})
    console = Console(file=io.StringIO(), width=120)
    args = build_parser().parse_args(["show", url, "--json"])
    started = time.process_time()
    args.run(args, console)
    cpu_seconds = time.process_time() - started
    assert console.file.getvalue().count("\n") > 126_000
    assert cpu_seconds < fuzz_inputs.CASE_SECONDS
