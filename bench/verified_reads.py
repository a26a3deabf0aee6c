"""Verified reads on every core (issue 31 part 1): ``ckptfmt.verify`` against BLAKE3's own
multi-threaded hashing of the same chunk bytes (warm), and against ``cat`` of the same files to
/dev/null with the page cache dropped (cold); and the warm load of a MiniLM-shaped state (99 float32
tensors, 90 MB) with each ``verify`` mode against safetensors' ``load_file``.

    python bench/verified_reads.py [--mb 1024] [--repeats 7] [--loads 31] [--dir DIR]

A state of ``--mb`` MiB of float32 tensors (64 MiB each, uncompressed, as ``ckptfmt.save`` stores
them by default) is saved once; each repeat then times, in alternating order, the warm pair (verify,
then hashing each chunk's bytes already in memory with ``max_threads=AUTO``) and the cold pair
(verify and ``cat``, each after ``posix_fadvise(DONTNEED)`` on every chunk file). Prints the rates
and the median and range of the per-repeat ratios (verify's rate / the reference's). A load takes a
few milliseconds, so each repeat of the loads is ``--loads`` pairs (ckptfmt's load and ``load_file``,
alternated) and gives the median of each; the ratio is taken per repeat, as above. The verified load
is also paired with BLAKE3 hashing the state's 90 MB in memory on every core (``max_threads=AUTO``,
one buffer): the floor a verified load has, whatever it reads from.
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
    parser.add_argument("--loads", type=int, default=31, help="load pairs in a repeat of the loads (their medians)")
    parser.add_argument("--dir", default=None, help="where the repository goes (default: a temporary folder)")
    args = parser.parse_args()
    if args.repeats < 1 or args.loads < 1:
        parser.error("--repeats and --loads must be at least 1")
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
        loads = load_pairs(Path(folder), args.repeats, args.loads)
    print(f"{len(chunks)} chunk files, {total / 2**20:.0f} MiB, {args.repeats} repeats (alternating order)")
    for name, reference in (("warm", "blake3 AUTO hashing"), ("cold", "cat to /dev/null")):
        ours = [total / a / 1e9 for a, _ in seconds[name]]
        theirs = [total / b / 1e9 for _, b in seconds[name]]
        ratios = [b / a for a, b in seconds[name]]
        print(f"  {name}: verify {statistics.median(ours):.2f} GB/s ({min(ours):.2f}-{max(ours):.2f}), "
              f"{reference} {statistics.median(theirs):.2f} GB/s ({min(theirs):.2f}-{max(theirs):.2f}); "
              f"verify's rate / theirs: median {statistics.median(ratios):.2f}x "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    print(f"warm load of a MiniLM-shaped state (99 tensors, 90 MB), against safetensors' load_file "
          f"(each repeat the medians of {args.loads} alternated pairs):")
    for mode, pairs in loads.items():
        ours = [a * 1e3 for a, _ in pairs]
        ratios = [a / b for a, b in pairs]
        reference = "BLAKE3 AUTO of the 90 MB in memory" if mode == BLAKE3_PAIR else "load_file"
        shown = "True" if mode == BLAKE3_PAIR else repr(mode)
        print(f"  load(verify={shown}) {statistics.median(ours):.2f} ms ({min(ours):.2f}-{max(ours):.2f}); "
              f"/ {reference}: median {statistics.median(ratios):.2f}x "
              f"(range {min(ratios):.2f}-{max(ratios):.2f}); "
              f"{reference} {statistics.median(b for _, b in pairs) * 1e3:.2f} ms")


def minilm_state() -> dict[str, torch.Tensor]:
    """The tensors of all-MiniLM-L6-v2's shapes (embeddings, 6 layers), random."""
    torch.manual_seed(0)
    state = {"emb.word": torch.randn(30522, 384), "emb.pos": torch.randn(512, 384), "emb.type": torch.randn(2, 384)}
    for layer in range(6):
        for name in "qkvo":
            state[f"l{layer}.{name}.w"], state[f"l{layer}.{name}.b"] = torch.randn(384, 384), torch.randn(384)
        state[f"l{layer}.up.w"], state[f"l{layer}.up.b"] = torch.randn(1536, 384), torch.randn(1536)
        state[f"l{layer}.down.w"], state[f"l{layer}.down.b"] = torch.randn(384, 1536), torch.randn(384)
        for norm in ("ln1", "ln2"):
            state[f"l{layer}.{norm}.w"], state[f"l{layer}.{norm}.b"] = torch.randn(384), torch.randn(384)
    return state


def load_pairs(folder: Path, repeats: int, loads: int) -> dict[object, list[tuple[float, float]]]:
    """Per verify mode, (ckptfmt.load seconds, load_file seconds) of each repeat: the medians of ``loads``
    pairs, the order alternated from pair to pair."""
    from safetensors.torch import load_file, save_file

    state = minilm_state()
    url = ckptfmt.save(state, folder / "minilm" / "a")
    save_file(state, str(folder / "minilm.safetensors"))
    in_memory = b"".join(t.numpy().tobytes() for t in state.values())
    del state

    def timed(run) -> float:
        began = time.perf_counter()
        run()
        return time.perf_counter() - began
    modes: list[object] = [True, "once", False]
    for mode in modes:  # warm: the page cache, and "once" its memory of the files
        ckptfmt.load(url, verify=mode)
    theirs = lambda: load_file(str(folder / "minilm.safetensors"))
    runs: dict[object, tuple] = {mode: (lambda mode=mode: ckptfmt.load(url, verify=mode), theirs) for mode in modes}
    runs[BLAKE3_PAIR] = (lambda: ckptfmt.load(url, verify=True),
                         lambda: blake3.blake3(in_memory, max_threads=blake3.blake3.AUTO).digest())
    found: dict[object, list[tuple[float, float]]] = {mode: [] for mode in runs}
    for _ in range(repeats):
        for mode, (ours, theirs) in runs.items():
            times: tuple[list[float], list[float]] = ([], [])
            for pair in range(loads):
                if pair % 2 == 0:
                    a, b = timed(ours), timed(theirs)
                else:
                    b, a = timed(theirs), timed(ours)
                times[0].append(a)
                times[1].append(b)
            found[mode].append((statistics.median(times[0]), statistics.median(times[1])))
    return found


#: The pair of a verified load and BLAKE3's hashing of the same bytes in memory, in ``load_pairs``.
BLAKE3_PAIR = "True, against BLAKE3"


if __name__ == "__main__":
    main()
