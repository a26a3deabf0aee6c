"""Shared machinery for the ckptfmt benchmarks.

Builds the transformer-shaped test state, evicts checkpoints from the page
cache, runs competitors round-robin and renders results as rich tables.
Linux only (``posix_fadvise``, ``/proc``).
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

HIDDEN = 1024
FFN = 4096
VOCAB = 32000
PAGE_BYTES = 4096
GB = 1e9
MiB = 1 << 20

# Wide enough for the tables when stdout is not a terminal (rich would assume 80 columns).
console = Console(width=None if sys.stdout.isatty() else 160)
progress = Console(stderr=True, style="dim")


# --------------------------------------------------------------------------- state


def layer_shapes(index: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of one transformer block (attention, 2 layernorms, FFN)."""
    prefix = f"layers.{index}."
    shapes: dict[str, tuple[int, ...]] = {}
    for proj in ("q", "k", "v", "o"):
        shapes[f"{prefix}attn.{proj}.weight"] = (HIDDEN, HIDDEN)
        shapes[f"{prefix}attn.{proj}.bias"] = (HIDDEN,)
    for norm in ("ln1", "ln2"):
        shapes[f"{prefix}{norm}.weight"] = (HIDDEN,)
        shapes[f"{prefix}{norm}.bias"] = (HIDDEN,)
    shapes[f"{prefix}ffn.up.weight"] = (FFN, HIDDEN)
    shapes[f"{prefix}ffn.up.bias"] = (FFN,)
    shapes[f"{prefix}ffn.down.weight"] = (HIDDEN, FFN)
    shapes[f"{prefix}ffn.down.bias"] = (HIDDEN,)
    return shapes


def layers_for_size(size_gb: float) -> int:
    """Fewest blocks (at least 1) that make the fp32 state at least ``size_gb`` GB (1.3 -> 24)."""
    embed_bytes = VOCAB * HIDDEN * 4
    layer_bytes = sum(math.prod(s) for s in layer_shapes(0).values()) * 4
    return max(1, math.ceil((size_gb * GB - embed_bytes) / layer_bytes))


def build_state(size_gb: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A flat fp32 state dict of about ``size_gb`` GB filled with seeded randn."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (VOCAB, HIDDEN)}
    for index in range(layers_for_size(size_gb)):
        shapes.update(layer_shapes(index))
    return {key: torch.randn(shape, generator=gen) for key, shape in shapes.items()}


def refresh_content(state: Mapping[str, torch.Tensor], tag: int) -> None:
    """Make ``state`` content no save has seen: element 1 of every 4 KiB page := 1000 + tag.

    Every chunk of every tensor changes, so neither dedupe against earlier saves
    nor ckptfmt's in-process hash cache (keyed by memory address) can make a
    "first" save cheaper. Only element 1 of a page changes and ``touch`` reads
    element 0, so ``touch`` checksums stay valid.
    """
    with torch.no_grad():
        for tensor in state.values():
            step = max(1, PAGE_BYTES // tensor.element_size())
            tensor.view(-1)[1::step].fill_(1000.0 + tag)


def state_nbytes(state: Mapping[str, torch.Tensor]) -> int:
    """Total tensor payload in bytes."""
    return sum(t.numel() * t.element_size() for t in state.values())


def lazy_key(state: Mapping[str, torch.Tensor]) -> str:
    """Key of the 1024x4096 FFN down weight in the middle block (16 MiB fp32)."""
    keys = [k for k in state if k.endswith("ffn.down.weight")]
    return keys[len(keys) // 2]


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested dicts / lists / tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value)


def touch(obj: Any) -> float:
    """Read one element per 4 KiB page of every tensor; return their float64 sum.

    Forces lazily mapped data in from disk, and doubles as a checksum: the same
    tensors always give the same value.
    """
    total = 0.0
    for tensor in iter_tensors(obj):
        step = max(1, PAGE_BYTES // tensor.element_size())
        total += tensor.reshape(-1)[::step].double().sum().item()
    return total


def check_checksum(got: float, expected: float) -> None:
    """Raise if a ``touch`` checksum differs from the reference state's."""
    if not math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-6):
        raise ValueError(f"checksum mismatch: got {got!r}, expected {expected!r}")


# ---------------------------------------------------------------------- filesystem


def files_under(path: str | os.PathLike) -> list[Path]:
    """``path`` itself if it is a file, else every regular file below it."""
    path = Path(path)
    if path.is_file():
        return [path]
    return [Path(d) / f for d, _, names in os.walk(path) for f in names if (Path(d) / f).is_file()]


def evict(path: str | os.PathLike) -> None:
    """Drop every file under ``path`` from the page cache (fsync, then FADV_DONTNEED)."""
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_bytes(path: str | os.PathLike) -> int:
    """Sum of the sizes of every file under ``path``."""
    return sum(f.stat().st_size for f in files_under(path))


def fs_type(path: str | os.PathLike) -> str:
    """Filesystem type of the mount holding ``path`` (from /proc/mounts)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount_point, fstype, *_ = line.split()
            inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best):
                best, kind = mount_point, fstype
    return kind


class Scratch:
    """Numbered scratch directories per slot; a fresh one deletes the slot's previous one."""

    def __init__(self, root: Path):
        self.root = root
        self.current: dict[str, Path] = {}
        self._count = 0

    def fresh(self, slot: str) -> Path:
        """Create a new empty directory for ``slot`` and remove its predecessor."""
        old = self.current.pop(slot, None)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._count += 1
        safe_slot = re.sub(r"[^\w.-]", "_", slot)
        path = self.root / f"{safe_slot}-{self._count}"
        path.mkdir(parents=True)
        self.current[slot] = path
        return path


# -------------------------------------------------------------------------- timing


@dataclass
class Result:
    """Wall times of one competitor, or the error that stopped it."""

    times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else math.nan

    @property
    def min(self) -> float:
        return min(self.times) if self.times else math.nan

    def to_json(self) -> dict[str, Any]:
        return {"times_s": self.times, "median_s": nan_to_none(self.median),
                "min_s": nan_to_none(self.min), "error": self.error}


def nan_to_none(value: float) -> float | None:
    """JSON-friendly float."""
    return None if value is None or math.isnan(value) else value


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` and return (seconds, its value)."""
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def describe_error(exc: BaseException) -> str:
    """``Type: message (file:line)`` of the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def round_robin(label: str, competitors: Mapping[str, Callable[[int], float]], repeats: int,
                before_repeat: Callable[[int], None] | None = None) -> dict[str, Result]:
    """Call every competitor once per repeat, rotating the order each repeat.

    A competitor is ``fn(repeat) -> seconds`` and does its own untimed setup.
    The first exception disables it for the remaining repeats.
    """
    names = list(competitors)
    results = {name: Result() for name in names}
    for rep in range(repeats):
        if before_repeat is not None:
            before_repeat(rep)
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            result = results[name]
            if result.error is not None:
                continue
            gc.collect()
            try:
                seconds = competitors[name](rep)
            except Exception as exc:
                result.error = describe_error(exc)
                progress.print(f"{label} | {name}: FAILED {result.error}", markup=False)
                continue
            result.times.append(seconds)
            progress.print(f"{label} | repeat {rep + 1}/{repeats} | {name}: {fmt_time(seconds)}")
    return results


# -------------------------------------------------------------------------- output


def fmt_time(seconds: float) -> str:
    """Seconds as ``812.3 ms`` or ``2.41 s``."""
    if math.isnan(seconds):
        return "-"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def fmt_ratio(value: float) -> str:
    """A ratio as ``0.83x``."""
    return "-" if math.isnan(value) else f"{value:.2f}x"


def ratio(a: float, b: float) -> float:
    """a / b, NaN when either is missing."""
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def times_table(title: str, results: Mapping[str, Result], baselines: Iterable[str],
                nbytes: int | None = None) -> Table:
    """Median/min per competitor, optional GB/s, and median ratios to each baseline."""
    baselines = [b for b in baselines if b in results]
    table = Table(title=title, title_justify="left")
    table.add_column("competitor")
    table.add_column("median", justify="right")
    table.add_column("min", justify="right")
    if nbytes is not None:
        table.add_column("GB/s", justify="right")
    for base in baselines:
        table.add_column(f"vs {base}", justify="right")
    table.add_column("note", overflow="fold", max_width=60)
    for name, result in results.items():
        row = [name, fmt_time(result.median), fmt_time(result.min)]
        if nbytes is not None:
            row.append("-" if not result.times else f"{nbytes / GB / result.median:.2f}")
        row += [fmt_ratio(ratio(result.median, results[b].median)) for b in baselines]
        row.append(Text(result.error or "", style="red"))
        table.add_row(*row)
    return table


def median_int(values: list[int]) -> int | None:
    """Median of integers (upper middle), None if empty."""
    return sorted(values)[len(values) // 2] if values else None


def results_json(results: Mapping[str, Result]) -> dict[str, Any]:
    """Per-competitor JSON of a section."""
    return {name: result.to_json() for name, result in results.items()}


def run_in_scratch(parent: str | None, prefix: str, run: Callable[[Path], dict], json_path: str | None,
                   console: Console) -> int:
    """Run ``run(workdir)`` in a fresh scratch folder under ``parent`` (removed after), save its JSON."""
    base = Path(parent or "/tmp")
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        report = run(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
        console.print(f"results written to {json_path}")
    return 0


MOTO_SERVER = """
import logging, sys, time
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False).start()
while True:
    time.sleep(3600)
"""


def start_moto(nice: int = 0) -> tuple[subprocess.Popen, str]:
    """A moto S3 server in a child process (its CPU apart from the client's GIL), with this process's
    AWS settings pointed at it; returns the process and the endpoint URL. ``nice``: the server's CPU
    priority (19: it takes only the CPU time the client leaves, as a server on other machines would)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", MOTO_SERVER, str(port)])
    if nice:  # before the server starts its request threads, which inherit it
        os.setpriority(os.PRIO_PROCESS, server.pid, nice)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, endpoint
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.1)
