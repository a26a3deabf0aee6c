"""What Reed-Solomon parity (spec 5.6) costs: the code's speed against the library's own, a durable save
with parity against one without, and the bytes stored against a peer copy.

Usage (from the repository root)::

    python bench/parity.py [--size-gb 1.3] [--repeats 7] [--parity 8+2] [--code-mb 256]

1. The code, one thread: ``--code-mb`` of random bytes striped K+M in pieces of 16 MiB (ckptfmt's piece
   size), encoded by zfec's own ``Encoder.encode`` on the whole pieces and by ckptfmt's
   ``format.erasure.encode`` (zfec over 4 MiB column segments, the bound on memory), then M pieces lost and
   rebuilt by zfec's ``Decoder.decode`` and by ``erasure.rebuild``; each the median of ``--repeats``, the
   two in alternating order, with the ratio ckptfmt / zfec.
2. The save: the benchmark state saved durably with ``parity=`` and without, into fresh repositories in an
   order that alternates between repeats, the content changed before every save; the median of the
   per-repeat ratios (with / without) and their range.
3. The bytes: parity stored per byte of data, against one peer copy (a full copy: 1.0).
4. Rebuilding: with M chunks of a stripe deleted from the last saved checkpoint, ``repair`` with no
   replica, and its throughput over the bytes it rebuilt.
5. The asynchronous save: the time ``async_save`` blocks the caller, with parity and without (the parity is
   computed in the background with the rest of the save), and the time until its commit.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Scratch, build_state, console, refresh_content, state_nbytes

import ckptfmt
from ckptfmt.format import erasure
from ckptfmt.repository.parity import read_record
from ckptfmt.repository.protection import PIECE_LIMIT, parse_parity


def code_speed(k: int, m: int, total_mb: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per repeat of encoding and rebuilding ``total_mb`` of data, by zfec directly and by ckptfmt."""
    import zfec

    piece = PIECE_LIMIT
    stripes = max(1, total_mb * 2**20 // (piece * k))
    data = [[os.urandom(piece) for _ in range(k)] for _ in range(stripes)]
    encoder, decoder = zfec.Encoder(k, k + m), zfec.Decoder(k, k + m)
    wanted = tuple(range(k, k + m))
    parity = [encoder.encode(tuple(s), wanted) for s in data]
    lost = random.Random(0).sample(range(k), m)
    kept = [i for i in range(k + m) if i not in lost]

    def zfec_encode() -> None:
        for s in data:
            encoder.encode(tuple(s), wanted)

    def ckptfmt_encode() -> None:
        for s in data:
            erasure.encode(s, k, m, piece)

    def zfec_rebuild() -> None:
        for s, p in zip(data, parity):
            whole = s + list(p)
            decoder.decode(tuple(whole[i] for i in kept[:k]), tuple(kept[:k]))

    def ckptfmt_rebuild() -> None:
        for s, p in zip(data, parity):
            whole = s + list(p)
            erasure.rebuild({i: whole[i] for i in kept}, k, m, piece, k, lost)

    runs = {"zfec encode": zfec_encode, "ckptfmt encode": ckptfmt_encode, "zfec rebuild": zfec_rebuild,
            "ckptfmt rebuild": ckptfmt_rebuild}
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for repeat in range(repeats):
        order = names if repeat % 2 else names[::-1]
        for name in order:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    times["bytes"] = [stripes * k * piece]
    return times


def timed_save(state: dict, scratch: Scratch, slot: str, parity: str | None) -> tuple[float, str]:
    url = str(scratch.fresh(slot) / "repo" / "step-1")
    start = time.perf_counter()
    ckptfmt.save(state, url, parity=parity)
    return time.perf_counter() - start, url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--parity", default="8+2")
    parser.add_argument("--code-mb", type=int, default=256)
    args = parser.parse_args()
    k, m = parse_parity(args.parity)

    times = code_speed(k, m, args.code_mb, args.repeats)
    nbytes = times.pop("bytes")[0]
    console.print(f"code {k}+{m}, {nbytes / 2**20:.0f} MiB of data in pieces of {PIECE_LIMIT >> 20} MiB, one thread, "
                  f"median of {args.repeats}:")
    for what in ("encode", "rebuild"):
        ours, theirs = statistics.median(times[f"ckptfmt {what}"]), statistics.median(times[f"zfec {what}"])
        console.print(f"  {what}: zfec {nbytes / theirs / 1e9:.2f} GB/s, ckptfmt {nbytes / ours / 1e9:.2f} GB/s "
                      f"(ckptfmt / zfec time {ours / theirs:.3f}x)")

    state = build_state(args.size_gb)
    console.print(f"state: {len(state)} fp32 tensors, {state_nbytes(state) / 1e9:.2f} GB")
    saves: dict[bool, list[float]] = {True: [], False: []}
    ratios = []
    tag = 0
    with tempfile.TemporaryDirectory(prefix="ckptfmt-bench-parity-", dir=Path.cwd()) as root:
        scratch = Scratch(Path(root))
        protected_url = ""
        for repeat in range(args.repeats + 1):  # the first is a warm-up, not counted
            seconds = {}
            for with_parity in ((True, False) if repeat % 2 else (False, True)):
                tag += 1
                refresh_content(state, tag)
                seconds[with_parity], url = timed_save(state, scratch, str(with_parity),
                                                       args.parity if with_parity else None)
                if with_parity:
                    protected_url = url
            if repeat:
                for key, value in seconds.items():
                    saves[key].append(value)
                ratios.append(seconds[True] / seconds[False])
                console.print(f"repeat {repeat}: with parity {seconds[True]:.3f} s, without {seconds[False]:.3f} s, "
                              f"ratio {ratios[-1]:.3f}")
        console.print(f"durable save, median of {args.repeats}: with parity {statistics.median(saves[True]):.3f} s, "
                      f"without {statistics.median(saves[False]):.3f} s; ratio (median of per-repeat ratios) "
                      f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")

        repo_url, name = protected_url.rsplit("/", 1)
        repo = ckptfmt.Repository.open(repo_url)
        commit = repo.commit(name)
        record = read_record(repo.storage, name, commit.parity).record
        data = sum(size for _, size in record.objects)
        console.print(f"bytes: {data / 1e9:.3f} GB of objects, {record.parity_bytes / 1e9:.3f} GB of parity "
                      f"({record.parity_bytes / data:.3f} of the data; one peer copy: 1.000), "
                      f"{len(record.stripes)} stripes")

        stripe = max(record.stripes, key=lambda s: s.length)
        lost = [record.objects[p.obj] for p in stripe.pieces[:m]]
        for key, _ in lost:
            repo.storage.delete(key)
        start = time.perf_counter()
        report = ckptfmt.repair(repo_url)
        seconds = time.perf_counter() - start
        rebuilt = sum(size for _, size in lost)
        assert report.ok, report.unrepaired
        console.print(f"repair of {m} lost chunks ({rebuilt / 2**20:.0f} MiB) from parity alone: {seconds:.2f} s, "
                      "verification of the repository included")

        blocked: dict[bool, list[float]] = {True: [], False: []}
        done: dict[bool, list[float]] = {True: [], False: []}
        for repeat in range(args.repeats + 1):
            for with_parity in ((True, False) if repeat % 2 else (False, True)):
                tag += 1
                refresh_content(state, tag)
                url = str(scratch.fresh(f"async-{with_parity}") / "repo" / "step-1")
                start = time.perf_counter()
                future = ckptfmt.async_save(state, url, parity=args.parity if with_parity else None)
                returned = time.perf_counter()
                future.result()
                if repeat:
                    blocked[with_parity].append(returned - start)
                    done[with_parity].append(time.perf_counter() - start)
        console.print(f"async_save, median of {args.repeats}: blocks {statistics.median(blocked[True]):.3f} s with "
                      f"parity, {statistics.median(blocked[False]):.3f} s without; committed after "
                      f"{statistics.median(done[True]):.3f} s with, {statistics.median(done[False]):.3f} s without")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
