"""Time importing DeepSpeed ZeRO folders and record the import's peak memory.

Usage (from the repository root)::

    python bench/import_deepspeed.py [--layers 9] [--width 4096] [--stages 2 3] [--repeats 1]
                                     [--source DIR] [--dir /path] [--json PATH] [--no-zero-to-fp32]

Trains a stack of ``--layers`` ``Linear(width, width)`` (fp32, 151M parameters by
default) for one step with DeepSpeed on 2 CPU ranks (``DS_ACCELERATOR=cpu torchrun
--nproc_per_node 2``, gloo, torch Adam) and saves a ZeRO-2 and a ZeRO-3 checkpoint
(``--source``: into DIR, kept and reused by later runs). With 9 layers the ZeRO-2
partition boundary falls inside a row of layer 4's weight; ZeRO-3 cuts every weight
on a row boundary and every bias in two.

Then, per stage, in a fresh process each time, from a cold page cache into a fresh
repository: ``import_checkpoint`` (and, unless ``--no-zero-to-fp32``, DeepSpeed's own
``convert_zero_checkpoint_to_fp32_state_dict``, which writes only the fp32 weights,
not the optimizer moments). Memory is reported two ways:

* peak anonymous RSS: ``RssAnon`` of /proc/self/status, sampled every 2 ms on a thread
  (memory the process owns: what the import allocates);
* ``VmHWM`` (= getrusage's ru_maxrss): the peak of all resident pages, memory-mapped
  source files included (file-backed, clean, reclaimable page cache).

Both are given as growth over the process's RSS just before the import, against the
largest rank's files (one data-parallel rank's optimizer file plus its model file)
and the whole folder.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness import GB, MiB, Scratch, console, dir_bytes, evict, run_in_scratch

RANKS = 2
MEMORY_HEADROOM = 256 * MiB


# ------------------------------------------------------------------ the checkpoint (under torchrun)

def train(out: str, stage: int, layers: int, width: int) -> None:
    """One training step of the Linear stack under DeepSpeed ZeRO ``stage``, saved to ``out``."""
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000_000,
                              "allgather_bucket_size": 50_000_000},
        "steps_per_print": 1000,
    }
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    engine.save_checkpoint(out)
    dist.barrier()


def make_folder(folder: Path, stage: int, layers: int, width: int) -> None:
    """The ZeRO ``stage`` checkpoint in ``folder``, written by a 2-rank torchrun unless already there."""
    if (folder / "latest").exists():
        return
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", DS_BUILD_OPS="0")
    console.print(f"writing the ZeRO-{stage} checkpoint ({layers} x Linear({width}, {width})) to {folder}")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                    str(RANKS), __file__, "--train", str(folder), str(stage), str(layers), str(width)],
                   check=True, env=env)


def rank_bytes(folder: Path) -> int:
    """The largest data-parallel rank's files: its optimizer file and the model file(s) it reads."""
    tag = folder / (folder / "latest").read_text().strip()
    sizes = []
    for rank in range(RANKS):
        files = [tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                 tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"]
        if rank == 0:
            files.append(tag / "mp_rank_00_model_states.pt")
        sizes.append(sum(f.stat().st_size for f in files if f.exists()))
    return max(sizes)


# ------------------------------------------------------------------ one measured run (fresh process)

def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


class _AnonSampler:
    """The highest RssAnon seen, sampled every 2 ms on a thread (no kernel high-water mark for it)."""

    def __init__(self):
        self.peak = _status("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _status("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status("RssAnon"))


def measure(kind: str, source: str, dest: str) -> dict:
    """Run one import (or zero_to_fp32) here; its time and memory growth over this process's start."""
    if kind == "import":
        from ckptfmt.converters import import_checkpoint

        def job():
            import_checkpoint(source, dest)
    else:
        from deepspeed.utils.zero_to_fp32 import (
            convert_zero_checkpoint_to_fp32_state_dict,
        )

        def job():
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                convert_zero_checkpoint_to_fp32_state_dict(source, dest, max_shard_size=None)
    rss_before, anon_before = _status("VmRSS"), _status("RssAnon")
    sampler = _AnonSampler()
    started = time.perf_counter()
    job()
    seconds = time.perf_counter() - started
    anon_peak = sampler.stop()
    return {"seconds": seconds, "anon_growth": anon_peak - anon_before, "hwm_growth": _status("VmHWM") - rss_before}


def measured(kind: str, folder: Path, dest: Path) -> dict:
    evict(folder)
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    child = subprocess.run([sys.executable, __file__, "--measure", kind, str(folder), str(dest)],
                           check=False, capture_output=True, text=True, env=env)
    if child.returncode:
        raise RuntimeError(f"{kind} of {folder} failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ driver

def run_all(args, workdir: Path) -> dict:
    source = Path(args.source) if args.source else workdir / "source"
    scratch = Scratch(workdir / "out")
    kinds = ["import"] + ([] if args.no_zero_to_fp32 else ["zero_to_fp32"])
    result = {"layers": args.layers, "width": args.width, "ranks": RANKS, "stages": {}}
    for stage in args.stages:
        folder = source / f"z{stage}"
        make_folder(folder, stage, args.layers, args.width)
        runs = {kind: [measured(kind, folder, scratch.fresh(kind) / "out") for _ in range(args.repeats)]
                for kind in kinds}
        result["stages"][stage] = {"folder_bytes": dir_bytes(folder), "rank_bytes": rank_bytes(folder), "runs": runs}
    return result


def report(result: dict) -> None:
    for stage, found in result["stages"].items():
        folder, rank = found["folder_bytes"], found["rank_bytes"]
        console.print(f"ZeRO-{stage}: folder {folder / GB:.2f} GB, largest rank's files {rank / GB:.2f} GB "
                      f"(target: anonymous peak <= {(rank + MEMORY_HEADROOM) / GB:.2f} GB)")
        for kind, runs in found["runs"].items():
            for run in runs:
                console.print(f"  {kind}: {run['seconds']:.1f} s, peak RssAnon +{run['anon_growth'] / MiB:.0f} MiB, "
                              f"VmHWM +{run['hwm_growth'] / MiB:.0f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--source", default=None, help="folder for the checkpoints (written when missing, then kept)")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-zero-to-fp32", action="store_true")
    parser.add_argument("--train", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        out, stage, layers, width = args.train
        train(out, int(stage), int(layers), int(width))
        return 0
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return 0

    def run(workdir: Path) -> dict:
        result = run_all(args, workdir)
        report(result)
        return result

    return run_in_scratch(args.dir, "ckptfmt-import-ds-", run, args.json, console)


if __name__ == "__main__":
    sys.exit(main())
