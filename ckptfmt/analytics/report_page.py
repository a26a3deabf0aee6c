"""The page of a run's report (``ckptfmt.analytics.report``): one self-contained HTML file, its figures as
inline SVG and its style inline, so that it opens from a file, offline, in any browser. Tables: the run's
health, stragglers and why they straggled, slow saves, where the time went, its resumes, and the recorded
differences between the runs, their cells in words (yes/no, -, NaN), never Python's reprs. A figure with
nothing to draw is a sentence saying why in its place.
"""

from __future__ import annotations

import html
import os

from ckptfmt.analytics.certify import Certificate, resumes_verdict
from ckptfmt.analytics.compare import Comparison
from ckptfmt.analytics.goodput import CATEGORY_NAMES, Goodput
from ckptfmt.analytics.health import HealthReport
from ckptfmt.analytics.report_figures import Figure, Omitted, svg
from ckptfmt.analytics.stragglers import StragglerReport, episode_ranges
from ckptfmt.tools.formatting import counted, step_range, words, world_sizes

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
figure { margin: 1em 0; } figcaption { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.9em; } td, th { border: 1px solid #ccc; padding: 0.2em 0.6em; }
th { background: #f3f3f3; text-align: left; } .verdict { font-size: 1.1em; font-weight: bold; }
svg { max-width: 100%; height: auto; }
"""


def page(repo: str, built: dict, found: StragglerReport, well: HealthReport, comparison: Comparison | None, other,
          figures: list[Figure | Omitted], *, certificates: tuple[Certificate | None, list[Certificate]],
          spent: Goodput) -> str:
    e = html.escape
    checkpoints = built["checkpoints"]
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>ckptfmt report: {e(repo)}</title>"
             f"<style>{_STYLE}</style></head><body>",
             f"<h1>Run report: {e(repo)}</h1>",
             f"<p>{counted(checkpoints.num_rows, 'checkpoint')}, {counted(found.steps, 'recorded step')} on "
             f"{counted(found.ranks, 'rank')}.</p>"]
    certificate, resumes = certificates
    if comparison is not None:
        parts += _comparison_section(comparison, other, certificate)
    parts += _goodput_section(spent)
    parts += _resumes_section(resumes)
    parts += _health_section(well)
    parts += _stragglers_section(found)
    for figure in figures:
        parts.append(f"<h2>{e(figure.title)}</h2>")
        if isinstance(figure, Omitted):
            parts.append(f"<p id='figure-{figure.id}-omitted'>{e(figure.reason)}</p>")
        else:
            parts.append(f"<figure id='figure-{figure.id}'>{svg(figure.figure)}"
                         f"<figcaption>{e(figure.caption)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _comparison_section(comparison: Comparison, other, certificate: Certificate | None) -> list[str]:
    """The verdict, the certificate (does this run reproduce the other step by step), the first
    divergence and every recorded difference between the runs."""
    e = html.escape
    verdict = "identical" if comparison.identical else "different"
    parts = [f"<h2>Compared with {e(os.fspath(other))}</h2><p class='verdict' id='verdict'>The runs are "
             f"{verdict}.</p>"]
    if certificate is not None:
        parts.append(f"<p id='certificate'>Certified against it: {e(certificate.summary())}.</p>")
    divergence = comparison.first_divergence
    if divergence:
        how = (e(divergence.reason) if divergence.max_abs is None or divergence.max_rel is None else
               f"max abs difference {divergence.max_abs:.3g}, max relative {divergence.max_rel:.3g}")
        parts.append(f"<p>First divergence: step {divergence.step} ({e(divergence.checkpoint)}), "
                     f"tensor <code>{e(divergence.tensor)}</code>, {how}.</p>")
    differences = [d.to_json() for d in comparison.differences]
    columns = list(dict.fromkeys(key for d in differences for key in d))  # whatever compare records
    parts += ["<h3>Recorded differences</h3>",
              _table("differences", [c.replace("_", " ") for c in columns],
                     [[d.get(c) for c in columns] for d in differences])]
    return parts


def _goodput_section(spent: Goodput) -> list[str]:
    """Where the run's wall time went (``ckptfmt goodput``), and its restarts."""
    if not spent.ranks:
        return ["<h2>Where the time went</h2>", "<p id='goodput'>No training steps on record.</p>"]
    shares = spent.shares
    parts = ["<h2>Where the time went</h2>",
             f"<p id='goodput-summary'>{spent.wall_s:.1f} s of wall time on {counted(spent.ranks, 'rank')} "
             f"(the mean of the ranks): {shares['productive']:.1%} productive, "
             f"{counted(len(spent.restarts), 'restart')}, {counted(spent.steps_recomputed, 'step')} computed "
             "again.</p>",
             _table("goodput", ["share", "seconds", "of wall time"],
                    [[CATEGORY_NAMES[name], f"{value:.2f}", f"{shares[name]:.1%}"]
                     for name, value in spent.seconds.items()])]
    if spent.restarts:
        parts.append(_table("restarts", ["rank", "resumed from", "step", "down (s)", "world size"],
                            [[r["rank"], r["from"], r["from_step"], f"{r['seconds']:.2f}",
                              world_sizes(r["world_size"])] for r in spent.restarts]))
    return parts


def _resumes_section(resumes: list[Certificate]) -> list[str]:
    """The run's lineage: each resume, the checkpoint it came from, the world sizes, what it did not
    restore, and its certificate (the resume's own record, and the steps computed again)."""
    rows = []
    for certificate in resumes:
        place = certificate.lineage()
        rows.append([place["rank"], place["resumed_from"], place["step"], place["world_size"],
                     "-" if place["after_s"] is None else f"{place['after_s']:.1f}",
                     ", ".join(place["not_restored"]) or "all equal", certificate.summary()])
    return ["<h2>Resumes</h2>", f"<p id='resumes-verdict'>{resumes_verdict(resumes)}.</p>",
            _table("resumes", ["rank", "resumed from", "step", "world size", "seconds after the save",
                               "parts not restored", "certificate"], rows)]


def _stragglers_section(found: StragglerReport) -> list[str]:
    """The stragglers, why they straggled and the slow saves."""
    parts = ["<h2>Stragglers</h2>",
             _table("stragglers", ["rank", "host", "kind", "steps", "phase", "delay (s)", "x median"],
                    [[s.rank, s.host, s.kind, episode_ranges(s.episodes), s.phase, f"{s.delay_s:.3f}",
                      "-" if s.ratio is None else f"{s.ratio:.1f}"] for s in found.stragglers])]
    if found.explanations:
        parts.append("<h2>Why they straggled</h2>")
        parts.append(_table("straggler-causes", ["rank", "host", "steps", "cause", "evidence", "what to do"],
                            [[e["rank"], e["host"], step_range(e["first_step"], e["last_step"]), c["cause"],
                              c["evidence"], c["action"]] for e in found.explanations for c in e["causes"]]))
    if found.slow_saves:
        parts.append("<h2>Slow saves</h2>")
        parts.append(_table("slow-saves", ["rank", "host", "checkpoints", "phases", "delay (s)"],
                            [[s.rank, s.host, ", ".join(s.checkpoints), ", ".join(sorted(set(s.phases))),
                              f"{s.delay_s:.3f}"] for s in found.slow_saves]))
    return parts


def _health_section(well: HealthReport) -> list[str]:
    """The run's health as the page says it: NaN/Inf, norm jumps, metric spikes, unchanged, mostly zeros."""
    e = html.escape
    first = well.first_non_finite
    step = "" if first is None or first["step"] is None else f" (step {first['step']})"
    verdict = ("No NaN or Inf in any checkpoint" if first is None else
               f"NaN or Inf first in {e(first['checkpoint'])}{step}: "
               + ", ".join(f"<code>{e(t['key'])}</code>" for t in first["tensors"][:8]))
    return [
        "<h2>Training health</h2>", f"<p id='health-verdict'>{verdict}.</p>",
        "<h3>Norm jumps</h3>",
        _table("norm-jumps", ["group", "checkpoint", "step", "norm", "change"],
               [[j["group"], j["checkpoint"], j["step"], f"{j['norm']:.4g}", f"x{j['factor']:.3g}"]
                for j in well.jumps]),
        "<h3>Metric spikes</h3>",
        _table("metric-spikes", ["metric", "steps", "peak", "baseline", "between checkpoints"],
               [[s["metric"], step_range(s["first_step"], s["last_step"]),
                 "NaN" if s["non_finite"] else f"{s['peak']:.4g}",
                 "-" if s["baseline"] is None else f"{s['baseline']:.4g}",
                 f"{s['after'] or 'the start'} and {s['before'] or 'the end'}"] for s in well.metric_spikes]),
        "<h3>Unchanged tensors</h3>",
        _table("unchanged", ["tensor", "since", "checkpoints", "by"],
               [[u["key"], u["since"], u["checkpoints"], u["evidence"]] for u in well.unchanged]),
        "<h3>Mostly zeros</h3>",
        _table("mostly-zeros", ["tensor", "checkpoint", "zeros"],
               [[z["key"], z["checkpoint"], f"{z['share']:.1%}"] for z in well.mostly_zeros]),
    ]


def _table(table_id: str, header: list[str], rows: list[list]) -> str:
    if not rows:
        return f"<p id='{table_id}'>None.</p>"
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{e(words(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table id='{table_id}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
