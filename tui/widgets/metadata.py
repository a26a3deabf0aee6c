"""Rich renderables for the checkpoint screen's metadata tabs, one function per tab.

Each takes ``CheckpointReader.metadata`` (plus the tensor table where needed);
what to show comes from ``ckptfmt.tools.describe``, which never raises on missing or
odd fields (spec section 9), so the CLI's ``show`` and these tabs agree.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.console import Group as RenderGroup
from rich.pretty import Pretty
from rich.table import Table
from rich.text import Text

from ckptfmt.format.manifest import TensorEntry
from ckptfmt.format.shards import shard_ranks
from ckptfmt.tools import describe
from ckptfmt.tui.widgets.charts import bar_chart
from ckptfmt.tui.widgets.formatting import seconds


def _fields(rows: list[tuple[str, Any]], title: str | None = None) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for label, value in rows:
        table.add_row(Text(str(label)), value if isinstance(value, (Text, Table)) else Text(str(value)))
    if title:
        table.title, table.title_justify = title, "left"
    return table


def environment(meta: dict) -> RenderGroup:
    parts: list = [_fields(describe.environment(meta))]
    packages = describe.packages(meta)
    if packages:
        parts.append(_fields(packages, title=f"packages ({len(packages)})"))
    return RenderGroup(*parts)


def rng(meta: dict) -> Table:
    table = Table(title="RNG states saved, per rank", title_justify="left")
    for column in ("rank", "generators", "torch seed"):
        table.add_column(column)
    for row in describe.rng(meta):
        table.add_row(*map(Text, row))
    return table


def topology(meta: dict, entries: list[TensorEntry]) -> RenderGroup:
    shards = Counter(rank for entry in entries for rank in shard_ranks(entry.shards))
    table = Table(title="ranks", title_justify="left")
    for column in ("rank", "host", "local rank", "device", "shards written"):
        table.add_column(column)
    for r in describe.ranks(meta):
        shards_written = shards.get(r.rank, 0) if isinstance(r.rank, int) else 0
        table.add_row(*map(Text, (describe.text(r.rank), r.host, r.local_rank, r.device, str(shards_written))))
    spread = describe.placement(meta)
    placed = [Text(""), Text(f"placement: {spread}")] if spread else []
    return RenderGroup(_fields(describe.topology(meta)), Text(""), table, *placed)


def timing(meta: dict) -> RenderGroup:
    parts: list = []
    for rank in describe.save_timing(meta):
        parts.append(Text(f"save phases, rank {rank.rank} on {rank.host}: {seconds(rank.total_s)} in all",
                          style="bold"))
        parts.append(bar_chart(rank.phases, seconds))
        parts.append(Text(""))
    steps = describe.step_summary(meta)
    if steps:
        parts.append(Text(f"step times: {steps}"))
    return RenderGroup(*(parts or [Text("no timing recorded")]))


#: Bounds on what a tree of metadata shows: items per container, characters per string, levels.
_PRETTY_LIMITS = {"max_length": 200, "max_string": 2000, "max_depth": 32}


def user(meta: dict) -> Pretty | Text:
    value = meta.get("user")
    return Pretty(value, **_PRETTY_LIMITS) if value else Text("no user metadata")


def provenance(meta: dict) -> Pretty | Text:
    value = meta.get("provenance")
    return Pretty(value, **_PRETTY_LIMITS) if value else Text("saved by ckptfmt.save (not imported)")
