"""A run's report: figures and tables in one self-contained HTML file (and the figures as PNG files).

``report`` gathers what the page shows (the run's tables, stragglers and why they straggled, health,
goodput, its resumes certified and, with a second run, the comparison and whether the run reproduces
it), draws the figures (``report_figures``: matplotlib, off-screen) and writes the page
(``report_page``: inline SVG and style, no script, nothing fetched) and/or the figures as PNG files.
It returns what went in, as a ``RunReport``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ckptfmt.analytics._keyed import KeyedResult
from ckptfmt.analytics.certify import Certificate, certify, certify_resumes
from ckptfmt.analytics.compare import Comparison, compare
from ckptfmt.analytics.goodput import Goodput, goodput
from ckptfmt.analytics.health import HealthReport, health
from ckptfmt.analytics.report_figures import ANNOTATED_CELLS, Figure, Omitted, close, figures
from ckptfmt.analytics.report_page import page
from ckptfmt.analytics.stragglers import StragglerReport, Thresholds, stragglers
from ckptfmt.analytics.tables import tables

__all__ = ["ANNOTATED_CELLS", "Figure", "Omitted", "RunReport", "report"]


@dataclass(frozen=True)
class RunReport(KeyedResult):
    """What went into a run's report: the figures drawn and the analyses its tables show.

    ``made["figures"]`` (the dict ``report`` returned before) still works, with a DeprecationWarning."""

    figures: list[str]  # the ids of the figures drawn, in page order (those with nothing to draw left out)
    stragglers: StragglerReport  # judged by the report's thresholds, with their explanations
    comparison: Comparison | None  # with a run to compare with
    health: HealthReport
    certificate: Certificate | None  # does the run reproduce the one compared with, step by step
    resumes: list[Certificate]  # each resume of the run, certified
    goodput: Goodput

    _returned_by = "report()"

    def to_json(self) -> dict:
        return {"figures": self.figures, "stragglers": self.stragglers.to_json(),
                "comparison": None if self.comparison is None else self.comparison.to_json(),
                "health": self.health.to_json(),
                "certificate": None if self.certificate is None else self.certificate.to_json(),
                "resumes": [c.to_json() for c in self.resumes], "goodput": self.goodput.to_json()}

    def _as_dict(self) -> dict[str, Any]:
        return {"figures": self.figures, "stragglers": self.stragglers.to_json(), "comparison": self.comparison,
                "health": self.health, "certificate": self.certificate, "resumes": self.resumes,
                "goodput": self.goodput}


def report(repo: str | os.PathLike, *, html_path: str | os.PathLike | None = None,
           png_dir: str | os.PathLike | None = None, compare_with: str | os.PathLike | None = None,
           thresholds: Thresholds = Thresholds(), storage_options: dict | None = None,
           deep: bool = False) -> RunReport:
    """Write the report of run ``repo`` (compared with run ``compare_with`` if given) as ``html_path``
    and/or PNG files in ``png_dir``; returns what went in: figure ids, stragglers (judged by
    ``thresholds``), the comparison, the run's health (``deep``: with each tensor group's relative
    updates between checkpoints, which reads the tensors that changed)."""
    built = tables(repo, storage_options=storage_options)
    found = stragglers(built, thresholds=thresholds, explain=True)
    well = health(repo, deep=deep, storage_options=storage_options, built=built)
    comparison = compare(repo, compare_with, storage_options=storage_options) if compare_with else None
    resumes = certify_resumes(repo, storage_options=storage_options)
    spent = goodput(repo, storage_options=storage_options, built=built)
    certificate = cast(Certificate, certify(compare_with, repo, storage_options=storage_options)) \
        if compare_with else None
    other_steps = tables(compare_with, storage_options=storage_options)["steps"] if compare_with else None
    shown = figures(built, found, well, comparison, thresholds=thresholds, other_steps=other_steps)
    drawn = [f for f in shown if isinstance(f, Figure)]
    try:
        if png_dir is not None:
            folder = Path(png_dir)
            folder.mkdir(parents=True, exist_ok=True)
            for figure in drawn:
                figure.figure.savefig(folder / f"{figure.id}.png", dpi=110, bbox_inches="tight")
        if html_path is not None:
            Path(html_path).write_text(page(os.fspath(repo), built, found, well, comparison, compare_with, shown,
                                            certificates=(certificate, resumes), spent=spent), encoding="utf-8")
    finally:
        close(drawn)
    return RunReport(figures=[f.id for f in drawn], stragglers=found, comparison=comparison, health=well,
                     certificate=certificate, resumes=resumes, goodput=spent)
