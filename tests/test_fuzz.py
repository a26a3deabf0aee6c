"""A quick subset of the structure-aware fuzzing of tests/fuzz_inputs.py (the whole run is ``make fuzz``).

500 mutated manifests, commit records and markers, each read by open, load,
restore_rng, verify, diff, show and ls: nothing but CheckpointError subclasses,
each case within its time and memory bounds.
"""

from __future__ import annotations

import fuzz_inputs


def test_quick_subset_of_fuzzed_inputs():
    cases = fuzz_inputs.run(range(500), seed=1)
    report = fuzz_inputs.summary(cases)
    failures = [failure for case in cases for failure in case.failures]
    assert not failures, f"{len(failures)} reads broke the contract; the first:\n{failures[0]}"
    assert report["over_time"] == [] and report["over_memory"] == [], report
    # The fuzzer really exercised the readers: every target and kind of mutation, refusals and successes.
    assert set(report["by_target"]) == {"manifest", "commit", "marker"}
    assert {"swap-type", "inflate-count", "duplicate-key", "deep-nesting", "damage-bytes"} <= set(report["mutations"])
    outcomes = report["outcomes"]
    assert outcomes.get("load: ok", 0) > 20 and outcomes.get("load: ManifestError", 0) > 100, outcomes


def test_cases_that_once_went_over_their_bounds():
    """Case 6773 of seed 1 (two swapped types and an inflated count): ``show --json`` printed its
    126,000 lines through rich's JSON highlighter, 1.9-2.4 s of CPU and 120 MiB (bounds: 1 s, 256 MiB)."""
    cases = fuzz_inputs.run([6773], seed=1)
    report = fuzz_inputs.summary(cases)
    assert not cases[0].failures and report["over_time"] == [] and report["over_memory"] == [], report
    assert cases[0].outcomes["show --json"] == "ok"
