"""Checkpoint metadata as labelled text, for people: what ``ckptfmt show`` and the TUI's tabs print.

Spec section 9: readers must not fail on metadata. A checkpoint written by
another tool, an older or newer ckptfmt, or a hostile hand may hold any msgpack
value where ckptfmt writes a map (``environment.os`` a string, ``timing.ranks``
a number): every function here walks metadata defensively and shows what is
there rather than raising. Rendering (rich tables, bar charts) stays with the
CLI and the TUI; this module only decides what to say.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from ckptfmt.format.shards import chunk_rows
from ckptfmt.tools.formatting import counted, human_bytes, human_time, number, seconds, short, text


def field(value: Any, *path: str) -> Any:
    """``value[path[0]][path[1]]...``, or None where a step is missing or not a map."""
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def records(value: Any) -> list[Mapping]:
    """The maps in a list (ranks, GPUs, phases): other items, or a value that is no list, are left out."""
    if not isinstance(value, (list, tuple)):
        return []
    return [item for item in value if isinstance(item, Mapping)]


def mapping(value: Any) -> Mapping:
    """``value`` if it is a map, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def real(value: Any) -> float | None:
    """A number (not a bool) as a float, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _pairs(value: Any) -> str:
    """A map as 'k=v, k=v'; anything else as its text; '-' when empty or absent."""
    if isinstance(value, Mapping):
        return ", ".join(f"{short(k, 60)}={short(v, 80)}" for k, v in value.items()) or "-"
    return text(value)


def _list(value: Any) -> str:
    """A list as 'a, b, c'; anything else as its text; '-' when empty or absent."""
    if isinstance(value, (list, tuple)):
        return ", ".join(short(item, 80) for item in value) or "-"
    return text(value)


# -- the summary -----------------------------------------------------------------------------------

def _chunks(count: object) -> str:
    """'1 chunk', '12 chunks', or the recorded value as it is where it is no count."""
    return counted(count, "chunk") if type(count) is int else f"{text(count)} chunks"


def summary(meta: Mapping, url: str, ident: str, *, utc: bool = False) -> list[tuple[str, str]]:
    """The checkpoint's headline rows: where, which, step, when, parent, format, tensors, storage."""
    stats = mapping(meta.get("stats"))
    version = meta.get("format_version")
    return [
        ("checkpoint", url), ("id", ident), ("step", text(meta.get("step"))),
        ("created", human_time(meta.get("created_ns"), utc=utc)), ("parent", text(meta.get("parent") or None)),
        ("format", ".".join(map(str, version)) if isinstance(version, (list, tuple)) else text(version)),
        ("tensors", f"{text(stats.get('tensor_count'))} ({human_bytes(stats.get('tensor_bytes'))})"),
        ("stored", f"{human_bytes(stats.get('stored_bytes'))} in {_chunks(stats.get('chunk_count'))}, "
                   f"{human_bytes(stats.get('new_bytes'))} new"),
    ]


def delta_tensors(manifest) -> list[str]:
    """Keys of the tensors with a chunk stored as a delta against another (spec 5.5)."""
    if all(chunk.base is None for chunk in manifest.chunks):  # the usual checkpoint: no tensor to look at
        return []
    return [tensor.key for tensor in manifest.tensors
            if any(manifest.chunks[row].base is not None for row in set(chunk_rows(tensor.shards)))]


def delta_row(manifest) -> tuple[str, str] | None:
    """``show``'s line on delta-encoded tensors: how many, against which checkpoint, the first few."""
    keys = delta_tensors(manifest)
    if not keys:
        return None
    shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return "deltas", (f"{len(keys)} of {len(manifest.tensors)} tensors stored against {manifest.parent or '-'} "
                      f"(the parent): {shown}")


# -- tensor statistics -----------------------------------------------------------------------------

def stats_cells(stats: Mapping | None) -> tuple[str, str, str, str, str]:
    """A tensor's statistics (spec 6.10) as ``show`` prints them: mean, l2, absmax, the non-finite
    elements ('0', '3 nan', '1 +inf, 2 -inf') and the share of exact zeros; '-' where not recorded."""
    if not isinstance(stats, Mapping):
        return ("-",) * 5
    count = real(stats.get("count"))
    absmax = stats.get("absmax")
    if absmax is None and real(stats.get("min")) is not None and real(stats.get("max")) is not None:
        absmax = max(abs(stats["min"]), abs(stats["max"]))  # integer tensors record their extremes only
    bad = [(stats.get(name), label) for name, label in (("nan", "nan"), ("posinf", "+inf"), ("neginf", "-inf"))]
    non_finite = ", ".join(f"{n} {label}" for n, label in bad if real(n)) or ("0" if "nan" in stats else "-")
    zeros = real(stats.get("zeros"))
    share = "-" if zeros is None or not count else _share(zeros, count)
    return number(stats.get("mean")), number(stats.get("l2")), number(absmax), non_finite, share


def _share(part: float, whole: float) -> str:
    """'0%', '<0.01%', '12.5%', '100%': a share that says whether there are none, a few or all."""
    if part == 0 or part == whole:
        return f"{100 * part / whole:.0f}%"
    return "<0.01%" if part / whole < 1e-4 else f"{100 * part / whole:.3g}%"


# -- replicas --------------------------------------------------------------------------------------

def replica_divergences(meta: Mapping) -> list[str]:
    """Each replicated tensor whose copies differed between ranks when saved (spec 9.7), as text."""
    lines = []
    for entry in records(field(meta, "replicas", "divergent")):
        majority = sorted({r for r in entry.get("majority") or [] if isinstance(r, int)})
        others = sorted({r for r in entry.get("ranks") or [] if isinstance(r, int)} - set(majority))
        verb = "differs" if len(others) == 1 else "differ"
        lines.append(f"{text(entry.get('key'))}: {_ranks(others)} {verb} from the majority ({_ranks(majority)})")
    return lines


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "no rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def replicas(meta: Mapping) -> str | None:
    """What the save's comparison of replicated tensors found, or None when it made none."""
    found = meta.get("replicas")
    if not isinstance(found, Mapping):
        return None
    checked = text(found.get("checked"))
    divergent = replica_divergences(meta)
    if not divergent:
        return f"{checked} replicated tensors compared, all copies equal"
    return f"{checked} compared, {len(divergent)} differ: " + "; ".join(divergent)


# -- placement -------------------------------------------------------------------------------------

def placement(meta: Mapping) -> str | None:
    """Which node holds how many of a node-scoped checkpoint's chunks (spec 9.8), or None."""
    found = meta.get("placement")
    if not isinstance(found, Mapping):
        return None
    total = found.get("chunk_count")
    nodes = [f"{text(node.get('host'))} ({_ranks(sorted(node.get('ranks') or []))}): {text(node.get('chunks'))} of "
             f"{text(total)} chunks" for node in records(found.get("nodes"))]
    return f"node-scoped, {counted(len(nodes), 'node')}: " + "; ".join(nodes)


# -- environment -----------------------------------------------------------------------------------

def _leaf(value: Any, key: str) -> str:
    """``value[key]`` as text where ``value`` is a map, else ``value`` itself as text (a plain string)."""
    return text(value.get(key)) if isinstance(value, Mapping) else text(value)


def _gpus(value: Any) -> str:
    if value is None or isinstance(value, (list, tuple)):
        return ", ".join(text(gpu.get("name"), "?") for gpu in records(value)) or "none"
    return text(value)


def _torch(value: Any) -> str:
    if not isinstance(value, Mapping):
        return text(value)
    return (f"{text(value.get('version'))} (cuda {value.get('cuda')}, cudnn {value.get('cudnn')}, "
            f"nccl {value.get('nccl')})")


def _git(value: Any) -> str:
    if not isinstance(value, Mapping):
        return text(value or None)
    return f"{text(value.get('commit'))}{' (dirty)' if value.get('dirty') is True else ''}" if value else "-"


def _cpu(value: Any) -> str:
    if not isinstance(value, Mapping):
        return text(value)
    return f"{text(value.get('model'))} ({text(value.get('count'))} cores)"


def environment(meta: Mapping) -> list[tuple[str, str]]:
    """Host, OS, CPU, GPUs, Python, torch and its libraries, git state, determinism settings."""
    env = mapping(meta.get("environment"))
    determinism = env.get("determinism")
    flags = {k: v for k, v in determinism.items() if k != "env"} if isinstance(determinism, Mapping) else determinism
    return [
        ("host", text(env.get("hostname"))),
        ("os", _leaf(env.get("os"), "platform")),
        ("cpu", _cpu(env.get("cpu"))),
        ("gpus", _gpus(env.get("gpus"))),
        ("python", _leaf(env.get("python"), "version")),
        ("torch", _torch(env.get("torch"))),
        ("git", _git(env.get("git"))),
        ("determinism", _pairs(flags)),
        ("determinism env", _pairs(field(determinism, "env"))),
    ]


def packages(meta: Mapping) -> list[tuple[str, str]]:
    """Installed package versions, sorted by name."""
    found = field(meta, "environment", "packages")
    return sorted((short(k, 80), text(v)) for k, v in mapping(found).items())


# -- RNG -------------------------------------------------------------------------------------------

class RngRow(NamedTuple):
    rank: str
    generators: str
    torch_seed: str


def rng(meta: Mapping) -> list[RngRow]:
    """One row per rank's saved RNG states: which generators, and torch's initial seed."""
    rows = []
    for entry in records(meta.get("rng")):
        generators = ["torch_cpu"] * ("torch_cpu" in entry) + ["cuda"] * bool(entry.get("cuda")) + [
            name for name in ("numpy", "python") if entry.get(name)]
        rows.append(RngRow(text(entry.get("rank")), ", ".join(generators) or "-",
                           text(entry.get("torch_initial_seed"))))
    return rows


# -- topology --------------------------------------------------------------------------------------

class RankRow(NamedTuple):
    rank: Any
    host: str
    local_rank: str
    device: str


def topology(meta: Mapping) -> list[tuple[str, str]]:
    """World size, parallelism degrees and the ranks that wrote."""
    topo = mapping(meta.get("topology"))
    return [
        ("world size", text(topo.get("world_size"))),
        ("parallelism", _pairs(topo.get("parallelism"))),
        ("writer ranks", _list(topo.get("writer_ranks"))),
    ]


def ranks(meta: Mapping) -> list[RankRow]:
    """Each rank of the run: its host, local rank and device (``rank`` as stored, to match shards by)."""
    return [RankRow(r.get("rank"), text(r.get("host")), text(r.get("local_rank")), text(r.get("device")))
            for r in records(field(meta, "topology", "ranks"))]


# -- timing ----------------------------------------------------------------------------------------

class SaveTiming(NamedTuple):
    rank: str
    host: str
    total_s: float | None
    phases: list[tuple[str, float]]  # (name, seconds), phases without a number left out


def save_timing(meta: Mapping) -> list[SaveTiming]:
    """Each rank's save phases and total time."""
    rows = []
    for entry in records(field(meta, "timing", "ranks")):
        phases = [(text(p.get("name"), "?"), real(p.get("duration_s"))) for p in records(entry.get("phases"))]
        rows.append(SaveTiming(text(entry.get("rank")), text(entry.get("host")), real(entry.get("total_s")),
                               [(name, duration) for name, duration in phases if duration is not None]))
    return rows


def step_times(meta: Mapping) -> list[float]:
    """The recorded step durations in seconds (non-numbers left out)."""
    steps = field(meta, "timing", "steps")
    if not isinstance(steps, (list, tuple)):
        return []
    return [value for value in map(real, steps) if value is not None]


def step_summary(meta: Mapping) -> str | None:
    """'N recorded, mean .., min .., max ..', or None when no step times were recorded."""
    steps = step_times(meta)
    if not steps:
        return None
    return (f"{len(steps)} recorded, mean {seconds(sum(steps) / len(steps))}, "
            f"min {seconds(min(steps))}, max {seconds(max(steps))}")


__all__ = ["RankRow", "RngRow", "SaveTiming", "environment", "field", "mapping", "packages", "ranks", "real",
           "records", "replica_divergences", "replicas", "rng", "save_timing", "stats_cells", "step_summary",
           "step_times", "summary", "text", "topology"]
