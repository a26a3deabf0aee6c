"""The TUI's run screen (Textual Pilot): step times per rank with the stragglers, the save timeline, and
the comparison of two runs, on the real 4-rank DDP run of tests/support/ddp_runs.py (injected sleeps) and two
single-process runs."""

from __future__ import annotations

import pytest

from tests.support.helpers import require_module

require_module("textual")

from ckptfmt.analytics import stragglers
from ckptfmt.tui.app import create_app
from ckptfmt.tui.screens.repository import RepositoryScreen
from ckptfmt.tui.screens.run import RunScreen
from tests.support.ddp_runs import MIN_DELAY_S, NOISY_MACHINE, RUNS, flagged
from tests.support.runs import SICK_NAN, sick_run, train
from tests.support.tui_driving import SIZE, async_test, cells, settle, text_of


@async_test
async def test_the_run_screen_shows_stragglers_and_the_save_timeline(ddp_runs):
    run = ddp_runs["four"]
    found = flagged(stragglers(run, thresholds=NOISY_MACHINE))
    assert RUNS["four"].injected() <= found
    app = create_app([run], min_delay=MIN_DELAY_S)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert isinstance(app.screen, RepositoryScreen)
        await pilot.press("a")
        await settle(app, pilot)
        screen = app.screen
        assert isinstance(screen, RunScreen)
        assert "24 steps recorded on 4 ranks" in text_of(app, "#summary")
        rows = {row[0]: row for row in cells(screen.query_one("#stragglers"))}
        assert rows["1"][3] == "4-7" and rows["1"][4] == "data"  # rank 1 slept in data, steps 4-7
        assert rows["2"][3] == "15-16" and rows["2"][4] == "forward"
        heatmap = text_of(app, "#heatmap").splitlines()
        for rank in range(4):  # an x for each step the analysis found the rank delayed the others in
            line = next(line for line in heatmap if line.strip().startswith(f"rank {rank}"))
            assert line.count("x") == sum(1 for r, _ in found if r == rank), (rank, line)
        await pilot.press("right_square_bracket")
        await settle(app, pilot)
        timeline = text_of(app, "#timeline")
        assert "step-0007" in timeline and "step-0015" in timeline and "write_chunks" in timeline
        await pilot.press("escape")
        assert isinstance(app.screen, RepositoryScreen)


@async_test
async def test_the_run_screen_compares_two_runs(tmp_path):
    base, reordered = str(tmp_path / "base"), str(tmp_path / "reordered")
    train(base)
    train(reordered, shuffle_from=6)
    app = create_app([base], compare_with=reordered)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        screen = app.screen
        assert isinstance(screen, RunScreen)
        screen.query_one("#run-tabs").active = "compare-tab"
        await pilot.pause()
        verdict = text_of(app, "#verdict")
        assert "the runs are different" in verdict and "first divergence: step 7" in verdict
        differences = cells(screen.query_one("#differences"))
        assert [(d[0], d[1], d[2], d[6]) for d in differences] == [("yes", "data_order", "batch", "6")]
        assert differences[0][7].endswith("step 6, before the divergence at step 7"), differences[0]


@async_test
async def test_the_health_tab_shows_the_norms_the_nan_and_the_findings(tmp_path):
    run = str(tmp_path / "sick")
    sick_run(run)
    app = create_app([run])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("a")
        await settle(app, pilot)
        screen = app.screen
        assert isinstance(screen, RunScreen)
        screen.query_one("#run-tabs").active = "health-tab"
        await pilot.pause()
        verdict = text_of(app, "#health-verdict")
        assert f"NaN/Inf: first in step-{SICK_NAN:04d} (step {SICK_NAN}): model/0.bias" in verdict
        norms = text_of(app, "#norms").splitlines()
        scaled = next(line for line in norms if line.startswith("model.2"))
        assert "x" in scaled and any(bar in scaled for bar in "▁▂▃▄▅▆▇█")  # bars, and the jump marked
        findings = cells(screen.query_one("#findings"))
        kinds = {row[0] for row in findings}
        assert {"norm jump", "metric spike", "unchanged", "mostly zeros"} <= kinds
        assert ("unchanged", "table") in {(row[0], row[1]) for row in findings}


def test_compare_needs_one_target():
    with pytest.raises(ValueError, match="--compare takes one run"):
        create_app(["a", "b"], compare_with="c")


def test_a_negative_least_delay_is_refused():
    with pytest.raises(ValueError, match="--min-delay must be 0 or more"):
        create_app(["a"], min_delay=-0.5)
