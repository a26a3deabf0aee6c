"""What replicating to S3 costs the training loop: a CheckpointManager saving a 1.3 GB state to local
disk (async) every N steps, with and without a second tier on S3 (moto, in its own process).

    python bench/tiers.py [--gb 1.3] [--saves 8] [--every 5] [--step-s 1.0] [--server-nice 19]

Each step is ``--step-s`` seconds of matmuls (the GIL released, as in real
training); every weight changes before each save, so every save writes, and
replicates, the whole state. Prints the median stall per save (the time
``manager.save`` blocks the loop) and the median step time, for local only and
for local + S3, and their ratios. moto keeps objects in memory on this machine
and shares its cores: an upper bound on the interference of a real S3 upload.
``--server-nice 19`` runs it at the lowest CPU priority, closer to a server on
other machines, which takes none of the training loop's cores.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid

import torch
from harness import build_state, refresh_content, start_moto, state_nbytes

import ckptfmt
from ckptfmt import CheckpointManager, Retention, Tier
from ckptfmt.saving import asynchronous, in_flight


def compute(seconds: float, a: torch.Tensor) -> None:
    """Matmuls for about ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


class WaitClock:
    """Times ``async_save``'s wait for the previous save of the repository: the part of a stall that is
    not the staging copy."""

    def __init__(self):
        self.seconds = 0.0
        self.original = in_flight.wait_for_previous

    def __call__(self, url):
        started = time.perf_counter()
        try:
            return self.original(url)
        finally:
            self.seconds += time.perf_counter() - started


def run(tiers: list, state: dict, saves: int, every: int, step_s: float, tag: int,
        housekeeping: str = "auto") -> dict:
    a = torch.randn(512, 512)
    stalls, waits, steps = [], [], []
    clock = asynchronous.in_flight.wait_for_previous = WaitClock()
    with CheckpointManager(tiers=tiers, keep_last=2, async_save=True, interval=every,
                           housekeeping=housekeeping) as manager:
        start = (manager.latest() or 0) + 1  # as a training script resumes (S3 listed from the loop's thread)
        for step in range(start, start + saves * every):
            started = time.perf_counter()
            compute(step_s, a)
            steps.append(time.perf_counter() - started)
            if step % every == 0:
                refresh_content(state, tag + step)
                started, waited = time.perf_counter(), clock.seconds
                manager.save(step, state)
                stalls.append(time.perf_counter() - started)
                waits.append(clock.seconds - waited)
        drain = time.perf_counter()
        manager.wait()
        drain = time.perf_counter() - drain
    asynchronous.in_flight.wait_for_previous = clock.original
    # the first save allocates the staging buffers: the median is of the saves after it
    return {"stall": statistics.median(stalls[1:]), "stalls": stalls, "waits": waits, "step": statistics.median(steps),
            "drain": drain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.3)
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--every", type=int, default=5, help="steps between saves")
    parser.add_argument("--step-s", type=float, default=1.0, help="seconds of compute per step")
    parser.add_argument("--server-nice", type=int, default=0, help="the moto server's nice value")
    args = parser.parse_args()
    server, endpoint = start_moto(nice=args.server_nice)
    try:
        import boto3

        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        state = build_state(args.gb)
        print(f"state {state_nbytes(state) / 1e9:.2f} GB, save every {args.every} steps of {args.step_s} s, "
              f"{args.saves} saves per run; moto at nice {args.server_nice}")
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            results["local"] = run([f"{tmp}/local-only"], state, args.saves, args.every, args.step_s, 0)
            for tag, housekeeping in enumerate(("process", "thread"), start=1):
                remote = f"s3://{bucket}/{housekeeping}"
                results[f"local + s3, copies on a {housekeeping}"] = run(
                    [f"{tmp}/local-{housekeeping}", Tier(remote, Retention(keep_last=1))], state, args.saves,
                    args.every, args.step_s, 10_000 * tag, housekeeping)
                assert ckptfmt.verify(remote).ok
        for label, r in results.items():
            print(f"{label:33s} stall {r['stall']:.3f} s (each: {', '.join(f'{s:.3f}' for s in r['stalls'])}; "
                  f"of which waiting for the previous save: {', '.join(f'{w:.3f}' for w in r['waits'])}); "
                  f"step {r['step']:.3f} s; wait at the end {r['drain']:.1f} s")
        base = results.pop("local")
        for label, tiered in results.items():
            print(f"{label}: stall {tiered['stall'] / base['stall']:.2f}x local only's, "
                  f"step time {tiered['step'] / base['step']:.2f}x")
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
