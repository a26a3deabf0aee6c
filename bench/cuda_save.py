"""GPU state to disk and back: ckptfmt against torch.save and safetensors, side by side (needs CUDA).

    python bench/cuda_save.py [--size-gb 1.3] [--repeats 5] [--dir /path] [--json out.json]

The state of bench/run.py (fp32, 385 tensors at 1.34 GB), on the GPU. Each repeat
makes content no save has seen (``refresh_content``, on the GPU), then runs the
savers in an order rotated every repeat, each into a fresh folder, durable when
timed (fsync of files and folders; ckptfmt's own save is durable when it returns):

- ``ckptfmt``: ``ckptfmt.save`` of the GPU tensors (copied to pinned host buffers
  on a side stream, hashed, statistics on);
- ``ckptfmt async: stall``: how long ``ckptfmt.async_save`` holds the loop (the
  copy to host), and ``ckptfmt async: total`` until its future says committed;
  its saves go to one repository, as a run's do, so its pinned buffers are
  allocated by a first save (its stall printed apart) and reused after;
- ``torch.save``, ``safetensors``: their own copies to host, then fsync.

Then loads onto the GPU, each timed until the device has the last byte
(``torch.cuda.synchronize``): ``ckptfmt.load(map_location="cuda")`` (verified),
``torch.load(map_location="cuda", mmap=True)`` and safetensors' ``load_file(device=...)``.
Reported: medians, ranges and per-repeat ratios to torch.save/torch.load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from competitors import save_safetensors, save_torch
from harness import (
    GB,
    Result,
    Scratch,
    build_state,
    refresh_content,
    round_robin,
    run_in_scratch,
    state_nbytes,
    times_table,
)
from rich.console import Console

import ckptfmt


def per_repeat_ratios(results: dict[str, Result], baseline: str) -> dict[str, str]:
    """Median and range of each competitor's per-repeat time over the baseline's."""
    out = {}
    for name, result in results.items():
        pairs = [a / b for a, b in zip(result.times, results[baseline].times)]
        if pairs and name != baseline:
            out[name] = f"{statistics.median(pairs):.2f}x ({min(pairs):.2f}-{max(pairs):.2f})"
    return out


def timed_call(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def run(workdir: Path, size_gb: float, repeats: int, console: Console) -> dict:
    state = {key: value.cuda() for key, value in build_state(size_gb).items()}
    nbytes = state_nbytes(state)
    console.print(f"{torch.cuda.get_device_name(0)}: {len(state)} tensors, {nbytes / GB:.2f} GB on the GPU, "
                  f"{repeats} repeats")
    scratch = Scratch(workdir)
    saved: dict[str, str] = {}
    async_stalls: list[float] = []

    def saver(name: str, save: Callable[[Path], str]) -> Callable[[int], float]:
        def timed(repeat: int) -> float:
            out = scratch.fresh(name)
            torch.cuda.synchronize()
            start = time.perf_counter()
            saved[name] = save(out)
            return time.perf_counter() - start
        return timed

    async_repo = workdir / "async-repo"  # one repository: its staging buffers are pinned once, then reused
    saves = iter(range(10**6))

    def async_save(stalls: list[float]) -> str:
        torch.cuda.synchronize()
        start = time.perf_counter()
        future = ckptfmt.async_save(state, async_repo / f"s{next(saves)}")
        stalls.append(time.perf_counter() - start)
        return future.result(timeout=600)

    first_stall: list[float] = []
    saved["async"] = async_save(first_stall)
    console.print(f"first async_save's stall (pins {nbytes / GB:.2f} GB of host buffers): {first_stall[0]:.2f} s")

    savers = {
        "ckptfmt": saver("ckptfmt", lambda out: ckptfmt.save(state, out / "repo" / "a")),
        "ckptfmt async: total": lambda repeat: timed_call(lambda: async_save(async_stalls)),
        "torch.save": saver("torch", lambda out: save_torch(state, out, "state")),
        "safetensors": saver("safetensors", lambda out: save_safetensors(state, out, "state")),
    }
    save_results = round_robin("save", savers, repeats, before_repeat=lambda rep: refresh_content(state, rep))
    save_results["ckptfmt async: stall"] = Result(times=async_stalls)

    def loader(load: Callable[[], dict]) -> Callable[[int], float]:
        def timed(repeat: int) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            loaded = load()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            assert all(tensor.is_cuda for tensor in loaded.values())
            return seconds
        return timed

    from safetensors.torch import load_file

    loaders = {
        "ckptfmt": loader(lambda: ckptfmt.load(saved["ckptfmt"], map_location="cuda")),
        "torch.load": loader(lambda: torch.load(saved["torch"], map_location="cuda", mmap=True, weights_only=True)),
        "safetensors": loader(lambda: load_file(saved["safetensors"], device="cuda:0")),
    }
    load_results = round_robin("load", loaders, repeats)
    for title, results, baseline in (("GPU state to disk, durable", save_results, "torch.save"),
                                     ("disk to GPU, warm cache", load_results, "torch.load")):
        console.print(times_table(title, results, [baseline, "safetensors"], nbytes))
        for name, text in per_repeat_ratios(results, baseline).items():
            console.print(f"  {name} / {baseline} per repeat: {text}")
    return {"device": torch.cuda.get_device_name(0), "bytes": nbytes,
            "save": {name: r.to_json() for name, r in save_results.items()},
            "load": {name: r.to_json() for name, r in load_results.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", help="where the scratch folders go (default /tmp)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    console = Console()
    if not torch.cuda.is_available():
        console.print("no CUDA device: nothing to measure")
        return 2
    return run_in_scratch(args.dir, "ckptfmt-cuda-", lambda workdir: run(workdir, args.size_gb, args.repeats,
                                                                          console), args.json, console)


if __name__ == "__main__":
    sys.exit(main())
