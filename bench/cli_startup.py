"""How fast the inspection tool starts: whole processes, paired against a bare Python (issue 28, part 1).

Each command runs as users run it (``ckptfmt ls REPO``...) on a small repository, paired with
``python -c "import fsspec, msgpack, blake3"`` (what any tool reading the format needs), the order of
each pair alternated; the figure is the median of the per-pair ratios, with their spread. Also: the
seconds from ``ckptfmt tui REPO`` starting to its first screen (driven in tmux, polled every 10 ms)
against the bare Python's median, and the replication child's peak resident memory (a manager with two
tiers saving three checkpoints, the child's VmHWM read while it lives).

    python bench/cli_startup.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

BARE = [sys.executable, "-c", "import fsspec, msgpack, blake3"]
CLI = [sys.executable, "-m", "ckptfmt.cli"]


def make_repository(folder: Path) -> Path:
    """Three small checkpoints (a few tensors each, and the steps timed between them), saved in a child so
    that this process stays bare."""
    repo = folder / "repo"
    program = ("import torch, ckptfmt\n"
               "timer = ckptfmt.StepTimer()\n"
               "for step in range(3):\n"
               "    for index in range(10):\n"
               "        with timer.step(step * 10 + index), timer.phase('forward'):\n"
               "            pass\n"
               "    state = {'model': {f'l{i}': torch.randn(64, 64) for i in range(8)}, 'step': step}\n"
               f"    ckptfmt.save(state, {str(repo)!r} + f'/step-{{step}}', step=step, timer=timer)\n")
    subprocess.run([sys.executable, "-c", program], check=True, timeout=300)
    return repo


def wall(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=120)
    return time.perf_counter() - started


def paired(command: list[str], repeats: int) -> tuple[list[float], list[float]]:
    """(command's seconds, bare Python's seconds) per pair, the order alternated pair by pair."""
    mine, bare = [], []
    wall(command), wall(BARE)  # warm the page cache and the bytecode caches
    for i in range(repeats):
        if i % 2:
            bare.append(wall(BARE))
            mine.append(wall(command))
        else:
            mine.append(wall(command))
            bare.append(wall(BARE))
    return mine, bare


def first_screen(repo: Path, repeats: int) -> list[float]:
    """Seconds from starting ``ckptfmt tui REPO`` in an 80x24 tmux window to the repository on screen."""
    if shutil.which("tmux") is None:
        return []
    found = []
    for _ in range(repeats):
        session = f"bench-{uuid.uuid4().hex[:8]}"
        started = time.perf_counter()
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24",
                        " ".join([*CLI, "tui", str(repo)])], check=True)
        try:
            while time.perf_counter() - started < 60:
                screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                        text=True).stdout
                if "step-2" in screen:
                    found.append(time.perf_counter() - started)
                    break
                time.sleep(0.01)
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    return found


def child_peak_mib(folder: Path) -> float:
    """The replication child's peak resident memory (VmHWM) in MiB, read from /proc while it is alive, after
    it copied three checkpoints (rusage cannot tell: a child's count includes its parent's pages between its
    fork and its exec)."""
    program = (
        "import torch, ckptfmt\n"
        f"manager = ckptfmt.CheckpointManager(tiers=[{str(folder / 'fast')!r}, {str(folder / 'slow')!r}], "
        "housekeeping='process')\n"
        "for step in range(3):\n"
        "    manager.save(step, {'w': torch.randn(256, 1024)})\n"
        "manager.wait()\n"
        "status = open(f'/proc/{manager.housekeeper.pid}/status').read()\n"
        "manager.close()\n"
        "print(status.split('VmHWM:')[1].split()[0])\n")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=300)
    return int(result.stdout.split()[-1]) / 1024  # kB


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        repo = make_repository(folder)
        print(f"repository: {repo} (3 checkpoints); {args.repeats} alternated pairs each; "
              f"python {sys.version.split()[0]}")
        bare_all: list[float] = []
        for name, argv in (("ls", ["ls", str(repo)]), ("show", ["show", f"{repo}/step-1"]),
                           ("verify", ["verify", str(repo)]), ("stragglers", ["stragglers", str(repo)]),
                           ("goodput", ["goodput", str(repo)])):
            mine, bare = paired([*CLI, *argv], args.repeats)
            bare_all += bare
            ratios = [m / b for m, b in zip(mine, bare)]
            print(f"ckptfmt {name:10} {statistics.median(mine) * 1000:6.0f} ms; bare python "
                  f"{statistics.median(bare) * 1000:4.0f} ms; ratio {spread(ratios)}")
        screens = first_screen(repo, max(3, args.repeats // 3))
        if screens:
            extra = [s - statistics.median(bare_all) for s in screens]
            print(f"ckptfmt tui to its first screen: {spread(screens)} s; beyond a bare python: {spread(extra)} s")
        print(f"replication child peak memory: {child_peak_mib(folder):.0f} MiB")


if __name__ == "__main__":
    main()
