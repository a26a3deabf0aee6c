"""Rich renderables for the checkpoint screen's metadata tabs, one function per tab.

Each takes ``CheckpointReader.metadata`` (plus the tensor table where needed)
and never raises on missing fields: old or imported checkpoints may lack some.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.console import Group as RenderGroup
from rich.pretty import Pretty
from rich.table import Table
from rich.text import Text

from ...manifest import TensorEntry
from .charts import bar_chart
from .formatting import seconds


def _fields(rows: list[tuple[str, Any]], title: str | None = None) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for label, value in rows:
        table.add_row(label, value if isinstance(value, (Text, Table)) else Text(str(value)))
    if title:
        table.title, table.title_justify = title, "left"
    return table


def environment(meta: dict) -> RenderGroup:
    env = meta.get("environment") or {}
    torch_info = env.get("torch") or {}
    git = env.get("git") or {}
    determinism = env.get("determinism") or {}
    packages = env.get("packages") or {}
    rows = [
        ("host", env.get("hostname", "-")),
        ("os", (env.get("os") or {}).get("platform", "-")),
        ("cpu", f"{(env.get('cpu') or {}).get('model', '-')} ({(env.get('cpu') or {}).get('count', '-')} cores)"),
        ("gpus", ", ".join(g.get("name", "?") for g in env.get("gpus") or []) or "none"),
        ("python", (env.get("python") or {}).get("version", "-")),
        ("torch", (f"{torch_info.get('version', '-')} (cuda {torch_info.get('cuda')}, "
                   f"cudnn {torch_info.get('cudnn')}, nccl {torch_info.get('nccl')})")),
        ("git", f"{git.get('commit', '-')}{' (dirty)' if git.get('dirty') else ''}" if git else "-"),
        ("determinism", ", ".join(f"{k}={v}" for k, v in determinism.items() if k != "env") or "-"),
        ("determinism env", ", ".join(f"{k}={v}" for k, v in (determinism.get("env") or {}).items()) or "-"),
    ]
    parts: list = [_fields(rows)]
    if isinstance(packages, dict) and packages:
        parts.append(_fields(sorted(packages.items()), title=f"packages ({len(packages)})"))
    return RenderGroup(*parts)


def rng(meta: dict) -> Table:
    table = Table(title="RNG states saved, per rank", title_justify="left")
    for column in ("rank", "generators", "torch seed"):
        table.add_column(column)
    for entry in meta.get("rng") or []:
        generators = ["torch_cpu"] * ("torch_cpu" in entry) + ["cuda"] * bool(entry.get("cuda")) + [
            g for g in ("numpy", "python") if entry.get(g)
        ]
        table.add_row(str(entry.get("rank")), ", ".join(generators) or "-", str(entry.get("torch_initial_seed", "-")))
    return table


def topology(meta: dict, entries: list[TensorEntry]) -> RenderGroup:
    topo = meta.get("topology") or {}
    parallelism = topo.get("parallelism") or {}
    summary = _fields([
        ("world size", topo.get("world_size", "-")),
        ("parallelism", ", ".join(f"{k}={v}" for k, v in parallelism.items()) or "-"),
        ("writer ranks", ", ".join(map(str, topo.get("writer_ranks") or [])) or "-"),
    ])
    shards = Counter(shard.rank for entry in entries for shard in entry.shards)
    table = Table(title="ranks", title_justify="left")
    for column in ("rank", "host", "local rank", "device", "shards written"):
        table.add_column(column)
    for r in topo.get("ranks") or []:
        table.add_row(str(r.get("rank")), str(r.get("host")), str(r.get("local_rank")), str(r.get("device")),
                      str(shards.get(r.get("rank"), 0)))
    return RenderGroup(summary, Text(""), table)


def timing(meta: dict) -> RenderGroup:
    info = meta.get("timing") or {}
    parts: list = []
    for rank in info.get("ranks") or []:
        phases = [(p.get("name", "?"), float(p.get("duration_s", 0.0))) for p in rank.get("phases") or []]
        parts.append(Text(f"save phases, rank {rank.get('rank')} on {rank.get('host')}: "
                          f"{seconds(float(rank.get('total_s', 0.0)))} in all", style="bold"))
        parts.append(bar_chart(phases, seconds))
        parts.append(Text(""))
    steps = [float(s) for s in info.get("steps") or [] if isinstance(s, (int, float))]
    if steps:
        parts.append(Text(f"step times: {len(steps)} recorded, mean {seconds(sum(steps) / len(steps))}, "
                          f"min {seconds(min(steps))}, max {seconds(max(steps))}"))
    return RenderGroup(*(parts or [Text("no timing recorded")]))


def user(meta: dict) -> Pretty | Text:
    value = meta.get("user")
    return Pretty(value) if value else Text("no user metadata")


def provenance(meta: dict) -> Pretty | Text:
    value = meta.get("provenance")
    return Pretty(value) if value else Text("saved by ckptfmt.save (not imported)")
