"""`ckptfmt report`: one self-contained HTML page (and PNGs) of a run, rendered by a real headless Chromium.

The run is the 4-rank DDP run of tests/support/ddp_runs.py (with its injected
stragglers), compared with the 2-rank run: another world size, so another data
order, and the runs differ from their first common checkpoint on. The figures
are checked in the page's SVG: their text is SVG text, and the artists the
checks look for carry ids.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import ckptfmt
from ckptfmt.analytics import Thresholds
from ckptfmt.analytics.compare import CommonCheckpoint, Comparison
from ckptfmt.analytics.health import HealthReport
from ckptfmt.analytics.report import Omitted, RunReport, report
from ckptfmt.analytics.report_figures import _delay_heatmap, _divergence, _metrics, _non_finite, _norms, _updates
from ckptfmt.analytics.report_page import _stragglers_section
from ckptfmt.analytics.stragglers import StragglerReport
from tests.support import markers
from tests.support.ddp_runs import NOISY_MACHINE, RUNS, flagged
from tests.support.helpers import needs_tool
from tests.support.runs import SICK_LOSS_SPIKE, SICK_NAN, SICK_SCALED, sick_run, train

#: The 4-rank run's figures: it holds no NaN or Inf, so its page says so instead of drawing an empty chart.
FIGURES = ["step-time", "delays", "save-phases", "sizes", "metrics", "norms", "divergence"]
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def page(ddp_runs, tmp_path_factory) -> tuple[Path, RunReport]:
    out = tmp_path_factory.mktemp("page")
    made = report(ddp_runs["four"], html_path=out / "report.html", png_dir=out / "png", compare_with=ddp_runs["two"],
                  thresholds=NOISY_MACHINE)
    return out, made


@pytest.fixture(scope="module")
def two_rank_page(ddp_runs, tmp_path_factory) -> Path:
    """The page of the 2-rank run, alone: its heatmaps have two rows."""
    out = tmp_path_factory.mktemp("two-rank-page")
    report(ddp_runs["two"], html_path=out / "report.html", thresholds=NOISY_MACHINE)
    return out


def figure_svg(out: Path, figure: str, page: str = "report.html") -> ElementTree.Element:
    """The parsed inline SVG of one figure of the page."""
    text = (out / page).read_text()
    markup = re.search(rf"<figure id='figure-{figure}'>(<svg\b.*?</svg>)", text, flags=re.S).group(1)
    return ElementTree.fromstring(markup)


def by_id(svg: ElementTree.Element, prefix: str) -> list[ElementTree.Element]:
    return [e for e in svg.iter() if e.get("id", "").startswith(prefix)]


def text_of(element: ElementTree.Element) -> str:
    return "".join(t.text or "" for t in element.iter(f"{SVG}text"))


def test_the_page_holds_every_figure_and_table_and_needs_no_network(page):
    out, made = page
    assert made.figures == FIGURES
    text = (out / "report.html").read_text()
    for figure in FIGURES:
        assert re.search(rf"<figure id='figure-{figure}'><svg\b", text), figure
    assert "id='stragglers'" in text and "id='differences'" in text and "id='straggler-causes'" in text
    assert "<p id='figure-non-finite-omitted'>" in text
    references = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", text)
    assert all(r.startswith("#") or r.startswith("data:") for r in references), references[:5]
    assert "<script" not in text and "@import" not in text
    # Every rank that slept is in the stragglers table (a rank the OS descheduled beyond the bound may be too).
    slept = {s.rank for s in made.stragglers.stragglers}
    assert {rank for rank, _ in RUNS["four"].injected()} <= slept


def test_the_differences_table_shows_every_field_compare_records(page):
    out, made = page
    table = re.search(r"<table id='differences'>.*?</table>", (out / "report.html").read_text(), flags=re.S).group(0)
    differences = [d.to_json() for d in made.comparison.differences]
    assert differences and table.count("<tr>") == len(differences) + 1
    for key in {key for d in differences for key in d}:
        assert f"<th>{key.replace('_', ' ')}</th>" in table


def test_what_went_in_is_typed_and_the_dict_it_was_still_reads_with_a_warning(page):
    """``report()`` returned a dict before its result was typed: indexing it by the dict's keys still works
    (its stragglers as the dict ``stragglers()`` returned), warning; ``to_json()`` is all of it as JSON."""
    _, made = page
    with pytest.warns(DeprecationWarning, match=r"report\(\)\['figures'\] is deprecated: use \.figures") as caught:
        assert made["figures"] == made.figures == FIGURES
    assert caught[0].filename == __file__  # the warning points at the caller's line
    with pytest.warns(DeprecationWarning, match=r"use \.stragglers"):
        assert made["stragglers"] == made.stragglers.to_json()
    for key in ("comparison", "health", "certificate", "resumes", "goodput"):
        with pytest.warns(DeprecationWarning):
            assert made[key] is getattr(made, key)
    as_json = json.loads(json.dumps(made.to_json()))
    assert list(as_json) == ["figures", "stragglers", "comparison", "health", "certificate", "resumes", "goodput"]
    assert as_json["stragglers"] == made.stragglers.to_json() and as_json["comparison"]["identical"] is False


@pytest.mark.parametrize("world", [2, 4])
def test_the_heatmaps_label_their_axes_with_whole_steps_and_ranks(page, two_rank_page, world):
    out = two_rank_page if world == 2 else page[0]
    for figure in ("step-time", "delays"):
        heatmap = by_id(figure_svg(out, figure), "axes_1")[0]  # axes_2: the colour bar's, in seconds
        ranks = [text_of(tick) for tick in by_id(heatmap, "ytick_")]
        assert ranks == [str(rank) for rank in range(world)], (figure, ranks)  # 2 ranks: -0.5, 0.0, 0.5, ...
        steps = [text_of(tick) for tick in by_id(heatmap, "xtick_")]
        assert steps and all(re.fullmatch(r"\d+", step) for step in steps), (figure, steps)


def test_the_step_heatmap_crosses_each_straggler_step_once(page):
    out, made = page
    marks = by_id(figure_svg(out, "step-time"), "straggler-marks")
    assert len(marks) == 1 and len(list(marks[0].iter(f"{SVG}use"))) == len(flagged(made.stragglers.to_json()))


def test_a_comparison_plots_both_runs_metrics(page):
    out, _ = page
    svg = figure_svg(out, "metrics")
    for run, name in (("A", "four"), ("B", "two")):
        line = by_id(svg, f"metric-loss-{run}")
        assert len(line) == 1, run
        points = line[0].find(f"{SVG}path").get("d").count("L") + 1
        assert points == RUNS[name].steps, (run, points)  # one point per step
    assert "loss (A)" in text_of(svg) and "loss (B)" in text_of(svg)


def test_the_divergence_cells_can_be_told_apart_and_carry_their_counts(page):
    out, made = page
    checkpoints = made.comparison.checkpoints
    groups = sorted({g for c in checkpoints for g in c.groups_differing})
    assert len(checkpoints) == 3 and groups == ["model"]  # every tensor differs: one colour throughout
    svg = figure_svg(out, "divergence")
    cells = by_id(svg, "divergence-cells")[0].findall(f"{SVG}path")
    assert len(cells) == len(groups) * len(checkpoints)
    for cell in cells:  # each cell drawn with its own visible border
        style = dict(item.split(": ") for item in cell.get("style").split("; "))
        assert style["stroke"] == "#ffffff" and float(style["stroke-width"]) >= 1, style
    for row, group in enumerate(groups):
        for column, checkpoint in enumerate(checkpoints):
            value = text_of(by_id(svg, f"divergence-value-{row}-{column}")[0])
            assert value == str(checkpoint.groups_differing[group]), (row, column, value)


def test_the_figures_are_written_as_png_files(page):
    out, _ = page
    for figure in FIGURES:
        data = (out / "png" / f"{figure}.png").read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, figure


def test_the_cli_writes_the_page_and_refuses_to_write_nothing(ddp_runs, tmp_path):
    html = tmp_path / "cli.html"
    run = ddp_runs["four"]
    result = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "report", run, "--html", str(html)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert html.stat().st_size > 10_000 and "divergence" not in result.stdout  # nothing to compare with
    refused = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "report", run], capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 2 and "--html" in refused.stderr and refused.stderr.count("\n") == 1


CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)


@pytest.mark.browser
@needs_tool(CHROMIUM, reason="no Chromium (.ci/run installs it)")
def test_a_headless_browser_renders_the_page_with_its_figures(page, tmp_path):
    out, _ = page
    url = (out / "report.html").resolve().as_uri()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for figure in FIGURES:  # parsed into the document, each with its drawing
        assert re.search(rf'<figure id="figure-{figure}"><svg\b', dom.stdout), figure
    # Drawn rows of the page, against the same page with its drawings taken out: the figures render.
    bare = tmp_path / "bare.html"
    bare.write_text(re.sub(r"<svg\b.*?</svg>", "", (out / "report.html").read_text(), flags=re.S))
    assert drawn_rows(CHROMIUM, flags, url, tmp_path / "page.png") > drawn_rows(
        CHROMIUM, flags, bare.resolve().as_uri(), tmp_path / "bare.png") + 6 * 150


def drawn_rows(chromium: str, flags: list[str], url: str, shot: Path) -> int:
    """Rows of a 1200 x 6000 screenshot of ``url`` with ink across at least 5% of their width."""
    from PIL import Image

    markers.require("browser")
    subprocess.run([chromium, *flags, "--window-size=1200,6000", f"--screenshot={shot}", url], capture_output=True,
                   timeout=120, check=True)
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=float)
    assert pixels.shape == (6000, 1200)
    return int(((pixels < 200).mean(axis=1) > 0.05).sum())


@pytest.fixture(scope="module")
def sick_page(tmp_path_factory) -> tuple[Path, RunReport]:
    """The page of a run that falls ill on purpose (tests/support/runs.py), with its relative updates."""
    out = tmp_path_factory.mktemp("sick-page")
    sick_run(str(out / "run"))
    return out, report(str(out / "run"), html_path=out / "report.html", deep=True)


def test_the_health_figures_show_the_norm_jump_the_nan_and_the_updates(sick_page):
    out, made = sick_page
    assert {"norms", "non-finite", "updates"} <= set(made.figures)
    text = (out / "report.html").read_text()
    assert f"NaN or Inf first in step-{SICK_NAN:04d} (step {SICK_NAN}): <code>model/0.bias</code>" in text
    assert "id='norm-jumps'" in text and "id='metric-spikes'" in text and "id='unchanged'" in text
    norms = figure_svg(out, "norms")
    assert by_id(norms, "norm-model.2") and by_id(norms, "norm-jumps")  # the scaled layer's line, the jumps circled
    assert "Tensors holding NaN or Inf: first at step 55" in text_of(figure_svg(out, "non-finite"))
    assert by_id(figure_svg(out, "updates"), "update-cells")
    assert any(j["group"] == "model.2" and j["step"] == SICK_SCALED for j in made.health.jumps)


# -- what a reader sees: ranges, words, axes, and nothing drawn where there is nothing to draw -----------------
def cells(out: Path, page: str = "report.html") -> list[str]:
    """The text of every table cell of the page."""
    return re.findall(r"<td>(.*?)</td>", (out / page).read_text(), flags=re.S)


def ticks(svg: ElementTree.Element, axes: str, axis: str) -> list[str]:
    """The tick labels of one axis of a figure (``axes_2``: a colour bar's)."""
    return [text_of(tick) for tick in by_id(by_id(svg, axes)[0], f"{axis}tick_")]


PYTHON_REPRS = {"True", "False", "None", "nan", "inf", "-inf", "[]", "{}"}


def test_a_one_step_range_is_one_step(sick_page):
    out, made = sick_page
    spikes = re.search(r"<table id='metric-spikes'>.*?</table>", (out / "report.html").read_text(), flags=re.S)
    assert f"<td>{SICK_LOSS_SPIKE}</td>" in spikes.group(0)
    assert f"{SICK_LOSS_SPIKE}-{SICK_LOSS_SPIKE}" not in spikes.group(0)
    explained = {"rank": 3, "host": "h", "first_step": 20, "last_step": 20, "phase": "data", "samples": 2,
                 "causes": [{"cause": "data loading", "evidence": "e", "action": "a"}]}
    found = StragglerReport(steps=20, ranks=4, stragglers=[], hosts=[], slow_saves=[], explanations=[explained])
    section = "".join(_stragglers_section(found))
    assert "<td>20</td>" in section and "20-20" not in section


@pytest.fixture(scope="module")
def small_pages(tmp_path_factory) -> Path:
    """One-rank runs: one compared with another seed (different.html) and with itself (same.html)."""
    out = tmp_path_factory.mktemp("small-pages")
    train(str(out / "a"))
    train(str(out / "b"), seed=1)
    report(str(out / "a"), html_path=out / "different.html", compare_with=str(out / "b"))
    report(str(out / "a"), html_path=out / "same.html", compare_with=str(out / "a"))
    return out


def test_the_differences_read_as_words_not_python(small_pages):
    found = cells(small_pages, "different.html")
    assert "yes" in found  # the seed explains the divergence
    assert not PYTHON_REPRS & set(found), found
    text = (small_pages / "different.html").read_text()
    assert "max relative" in text and not re.search(r"max abs difference \d\.\d{4}", text)  # 3 digits
    assert "12 recorded steps on 1 rank." in text


def test_booleans_nan_and_a_missing_tensor_read_as_words(tmp_path):
    """Plain values True against False and NaN against 1.0; a tensor only in one run: no max abs difference."""
    for name, flag, scale, extra in (("a", True, float("nan"), True), ("b", False, 1.0, False)):
        state = {"flag": flag, "scale": scale, **({"extra": torch.ones(3)} if extra else {}), "w": torch.ones(2)}
        ckptfmt.save(state, f"{tmp_path / name}/step-0001", step=1)
    report(str(tmp_path / "a"), html_path=tmp_path / "report.html", compare_with=str(tmp_path / "b"))
    text, found = (tmp_path / "report.html").read_text(), cells(tmp_path)
    assert {"yes", "no", "NaN", "1.0"} <= set(found) and not PYTHON_REPRS & set(found), found
    assert "<code>extra</code>, only in a." in text
    assert not re.search(r"\bNone\b(?!\.</p>)", text)  # "None." says a table is empty


def test_a_run_without_nan_says_so_instead_of_an_empty_chart(small_pages):
    text = (small_pages / "different.html").read_text()
    assert "id='figure-non-finite'" not in text
    assert "<p id='figure-non-finite-omitted'>No tensor holds a NaN or an infinite value in any checkpoint.</p>" in text


def test_identical_runs_draw_no_divergence_and_differing_ones_count_in_whole_tensors(small_pages):
    same = (small_pages / "same.html").read_text()
    assert "id='figure-divergence'" not in same
    assert "<p id='figure-divergence-omitted'>No tensor&#x27;s bytes differ" in same
    colour_bar = ticks(figure_svg(small_pages, "divergence", "different.html"), "axes_2", "y")
    assert colour_bar and all(re.fullmatch(r"\d+", tick) for tick in colour_bar), colour_bar


def test_one_rank_is_one_tick_and_bytes_are_in_a_unit_that_fits(small_pages):
    assert ticks(figure_svg(small_pages, "step-time", "different.html"), "axes_1", "y") == ["0"]  # not -0.5 to 0.5
    sizes = figure_svg(small_pages, "sizes", "different.html")  # a few dozen bytes: not 6.5e-5 MiB
    assert all(re.fullmatch(r"\d+", tick) for tick in ticks(sizes, "axes_1", "y"))
    assert "MiB" not in text_of(sizes) and "e−" not in text_of(sizes), text_of(sizes)


def steady_steps(ranks: int = 2, steps: int = 12, loss: float = 1.0) -> pa.Table:
    """A steps table of ranks that all take 100 ms a step, 10 of it in ``data``: nobody delays anybody."""
    rows = [(rank, step) for rank in range(ranks) for step in range(steps)]
    starts = [1_700_000_000_000_000 + 100_000 * step for _, step in rows]
    return pa.table({"rank": [r for r, _ in rows], "host": ["h"] * len(rows), "step": [s for _, s in rows],
                     "start": pa.array(starts, pa.timestamp("us", tz="UTC")), "duration_s": [0.1] * len(rows),
                     "phase_data": [0.01] * len(rows), "phase_forward": [0.09] * len(rows),
                     "metric_loss": [loss] * len(rows)})


def still_health(norm: float = 0.0, moved: float = 0.0) -> HealthReport:
    """A run of two checkpoints whose one tensor group has norm ``norm`` and moved ``moved`` between them."""
    return HealthReport(run="r", checkpoints=[{"name": "c1", "step": 1}, {"name": "c2", "step": 2}],
                        first_non_finite=None, non_finite=[], group_norms={"model": [norm, norm]}, jumps=[],
                        unchanged=[], mostly_zeros=[], metric_spikes=[],
                        updates=[{"key": "model/w", "group": "model", "checkpoint": "c2", "previous": "c1",
                                  "moved_l2": moved, "l2": norm, "ratio": None}])


@pytest.mark.parametrize(("figure", "drawn"), [
    ("delays", lambda: _delay_heatmap(steady_steps(), Thresholds())),
    ("metrics", lambda: _metrics(steady_steps(loss=float("nan")), None)),
    ("norms", lambda: _norms(still_health())),
    ("non-finite", lambda: _non_finite(still_health(1.0))),
    ("updates", lambda: _updates(still_health(1.0))),
    ("divergence", lambda: _divergence(Comparison("a", "b", False, None, [],
                                                  [CommonCheckpoint(1, "a1", "b1", 0, {}, True)], [], []))),
])
def test_a_figure_with_nothing_to_draw_is_left_out_with_a_sentence(figure, drawn):
    """No delay, only NaN metrics, zero norms, no NaN, nothing moved, nothing differs: no empty chart."""
    omitted = drawn()
    assert isinstance(omitted, Omitted) and omitted.id == figure and omitted.reason.endswith("."), omitted
