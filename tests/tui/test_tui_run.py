"""The TUI's run screen (Textual Pilot): step times per rank with the stragglers, the save timeline, and
the comparison of two runs, on the real 4-rank DDP run of tests/support/ddp_runs.py (injected sleeps) and two
single-process runs."""

from __future__ import annotations

import pytest

from tests.support.helpers import require_module

require_module("textual")

from ckptfmt.analytics import stragglers, tables
from ckptfmt.analytics.grids import slowest_save_phases
from ckptfmt.tui.app import create_app
from ckptfmt.tui.screens.repository import RepositoryScreen
from ckptfmt.tui.screens.run import RunScreen
from tests.support.ddp_runs import MIN_DELAY_S, NOISY_MACHINE, RUNS, flagged
from tests.support.runs import SICK_NAN, sick_run, train
from tests.support.tui_driving import SIZE, async_test, cells, settle, text_of
from tests.tui.terminal import SMALL, region_lines, screen_lines


@async_test
async def test_the_run_screen_shows_stragglers_and_the_save_timeline(ddp_runs):
    run = ddp_runs["four"]
    found = flagged(stragglers(run, thresholds=NOISY_MACHINE).to_json())
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
        assert "certified: diverges at step 6 (data), after 7 steps compared" in verdict  # the batches, step 6
        differences = cells(screen.query_one("#differences"))
        assert [(d[0], d[1], d[2], d[6]) for d in differences] == [("yes", "data_order", "batch", "6")]
        assert differences[0][7].endswith("step 6, before the divergence at step 7"), differences[0]


@async_test
async def test_the_run_screen_fits_80x24(ddp_runs):
    """The title names the run and the summary shows from its start; the heatmap has every rank; the save
    timeline shows each checkpoint's name and duration whole, and every phase of its legend."""
    run = ddp_runs["four"]
    names, phases, _ = slowest_save_phases(tables(run)["saves"])
    app = create_app([run], min_delay=MIN_DELAY_S)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        await pilot.press("a")
        await settle(app, pilot)
        lines = screen_lines(app)
        assert app.screen.sub_title == f"run {run}" and "ckptfmt — run /" in lines[0], lines[0]
        assert lines[1].startswith(" Run /"), lines[1]
        assert [line.split()[:2] for line in lines if line.startswith("rank ")] == [["rank", str(r)] for r in range(4)]
        await pilot.press("right_square_bracket")
        await settle(app, pilot)
        lines = screen_lines(app)
        for name in names:
            row = next(line for line in lines if line.startswith(f"{name} "))
            assert row.endswith(" ms"), row  # "185.2 ms", not "185.2 …"
        legend = " ".join(lines)
        assert all(f"█ {phase}" in legend for phase in phases), lines


@async_test
async def test_the_compare_tab_shows_both_values_at_80_columns(tmp_path):
    base, reordered = str(tmp_path / "base"), str(tmp_path / "reordered")
    train(base)
    train(reordered, shuffle_from=6)
    app = create_app([base], compare_with=reordered)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        app.screen.query_one("#run-tabs").active = "compare-tab"
        await pilot.pause()
        table = app.screen.query_one("#differences")
        header, first, *_ = region_lines(app, table)
        row = cells(table)[0]
        assert header.split()[4:6] == ["a", "b"] and row[4] in first and row[5] in first, (header, first)


async def open_tab(app, pilot, tab: str) -> RunScreen:
    """The run screen of the repository the app opened (``a``), showing ``tab``."""
    await settle(app, pilot)
    await pilot.press("a")
    await settle(app, pilot)
    screen = app.screen
    assert isinstance(screen, RunScreen)
    screen.query_one("#run-tabs").active = tab
    await pilot.pause()
    return screen


def run_resumed_without_its_optimizer(repo: str) -> None:
    """Two steps, a checkpoint, a resume that loads the model only (on record), two more steps."""
    import torch

    import ckptfmt

    def steps(model, optimizer, numbers: range) -> ckptfmt.StepTimer:
        timer = ckptfmt.StepTimer(system_interval=None)
        for step in numbers:
            with timer.step(step):
                timer.batch(torch.tensor([step]))
                loss = model(torch.full((2, 4), float(step))).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                timer.metrics(loss=loss.detach())
        return timer

    def made():
        model = torch.nn.Linear(4, 1)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    model, optimizer = made()
    timer = steps(model, optimizer, range(2))
    url = ckptfmt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{repo}/step-2",
                       step=2, timer=timer)
    model, optimizer = made()
    model.load_state_dict(ckptfmt.load(url)["model"])
    ckptfmt.record_resume(url, {"model": model, "optimizer": optimizer})
    timer = steps(model, optimizer, range(2, 4))
    ckptfmt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{repo}/step-4", step=4,
                 timer=timer)


@async_test
async def test_the_resumes_tab_shows_each_resume_with_what_it_did_not_restore(tmp_path):
    run = str(tmp_path / "run")
    run_resumed_without_its_optimizer(run)
    app = create_app([run])
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_tab(app, pilot, "resumes-tab")
        assert text_of(app, "#resumes-verdict").strip() == "A resume diverged"
        (row,) = cells(screen.query_one("#resumes"))
        assert row[:4] == ["0", "step-2", "2", "1"] and row[5:] == ["optimizer missing", "diverges at step 3 (load)"]


@async_test
async def test_the_health_tab_shows_the_norms_the_nan_and_the_findings(tmp_path):
    run = str(tmp_path / "sick")
    sick_run(run)
    app = create_app([run])
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_tab(app, pilot, "health-tab")
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


def test_findings_and_differences_read_as_words():
    """A one-step spike is one step, a spike at the run's start or end says so, and compare's values are
    words (yes/no, -, NaN), not Python's True, None and nan."""
    from types import SimpleNamespace

    from ckptfmt.analytics.compare import Difference
    from ckptfmt.tui.screens.run import difference_rows, findings

    well = SimpleNamespace(jumps=[], unchanged=[], mostly_zeros=[], metric_spikes=[
        {"metric": "loss", "first_step": 30, "last_step": 30, "non_finite": False, "peak": 9.5, "after": None,
         "before": "step-40"},
        {"metric": "loss", "first_step": 4, "last_step": 7, "non_finite": True, "peak": None, "after": "step-0",
         "before": None}])
    assert [row[2:] for row in findings(well)] == [("step 30", "peak 9.5, between the start and step-40"),
                                                   ("steps 4-7", "NaN, between step-0 and the end")]
    rows = difference_rows([Difference("values", "f", True, float("nan"), 3, False, "why")], width=200)
    assert rows == [("no", "values", "f", "-", "yes", "NaN", "3", "why")]
