"""Verified reads on every core (issue 31 part 1): ``ckptfmt.verify`` against BLAKE3's own
multi-threaded hashing of the same chunk bytes (warm), and against ``cat`` of the same files to
/dev/null with the page cache dropped (cold).

    python bench/verified_reads.py [--mb 1024] [--repeats 7] [--dir DIR]

A state of ``--mb`` MiB of float32 tensors (64 MiB each, uncompressed, as ``ckptfmt.save`` stores
them by default) is saved once; each repeat then times, in alternating order, the warm pair (verify,
then hashing each chunk's bytes already in memory with ``max_threads=AUTO``) and the cold pair
(verify and ``cat``, each after ``posix_fadvise(DONTNEED)`` on every chunk file). Prints the rates
and the median and range of the per-repeat ratios (verify's rate / the reference's).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import blake3
import torch
from harness import evict, files_under

import ckptfmt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where the repository goes (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        repo = Path(folder) / "repo"
        torch.manual_seed(0)
        ckptfmt.save({f"t{i}": torch.randn(16 * 2**20) for i in range(max(1, args.mb // 64))}, repo / "a",
                     tensor_stats=False)
        chunks = [path for path in files_under(repo / "chunks")]
        total = sum(path.stat().st_size for path in chunks)

        def verify() -> float:
            began = time.perf_counter()
            assert ckptfmt.verify(str(repo)).ok
            return time.perf_counter() - began

        def hash_all() -> float:
            data = [path.read_bytes() for path in chunks]  # in memory first: the hash alone is timed
            began = time.perf_counter()
            for each in data:
                blake3.blake3(each, max_threads=blake3.blake3.AUTO).digest()
            return time.perf_counter() - began

        def cat() -> float:
            began = time.perf_counter()
            subprocess.run(["cat", *map(str, chunks)], stdout=subprocess.DEVNULL, check=True)
            return time.perf_counter() - began

        def cold(run):
            def measured() -> float:
                for path in chunks:
                    evict(path)
                return run()
            return measured

        verify()  # warm the cache and the imports
        pairs = {"warm": (verify, hash_all), "cold": (cold(verify), cold(cat))}
        seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in pairs}
        for repeat in range(args.repeats):
            for name, (ours, theirs) in pairs.items():
                if repeat % 2 == 0:
                    a, b = ours(), theirs()
                else:
                    b, a = theirs(), ours()
                seconds[name].append((a, b))
    print(f"{len(chunks)} chunk files, {total / 2**20:.0f} MiB, {args.repeats} repeats (alternating order)")
    for name, reference in (("warm", "blake3 AUTO hashing"), ("cold", "cat to /dev/null")):
        ours = [total / a / 1e9 for a, _ in seconds[name]]
        theirs = [total / b / 1e9 for _, b in seconds[name]]
        ratios = [b / a for a, b in seconds[name]]
        print(f"  {name}: verify {statistics.median(ours):.2f} GB/s ({min(ours):.2f}-{max(ours):.2f}), "
              f"{reference} {statistics.median(theirs):.2f} GB/s ({min(theirs):.2f}-{max(theirs):.2f}); "
              f"verify's rate / theirs: median {statistics.median(ratios):.2f}x "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
