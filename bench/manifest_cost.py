"""What checking a manifest costs per byte: hostile layouts against an ordinary manifest of the same size.

    python bench/manifest_cost.py [--mib 16] [--repeats 1]

Builds three manifests in memory (no storage involved) and times
``Manifest.from_bytes`` on each ``--repeats`` times (the median and the
range), with the peak of Python allocations (tracemalloc) above the manifest
bytes themselves:

- ``ordinary``: many one-shard tensors, one piece each, as ``ckptfmt.save`` writes them;
- ``empty pieces``: one empty tensor whose shard lists millions of zero-length pieces;
- ``bricks``: tensors of 256 shards in 64 dimensions laid out as a brick wall
  (not a grid), so that every pair of shards must be told apart.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import msgpack

from ckptfmt.errors import ManifestError
from ckptfmt.format.manifest import FORMAT_VERSION, MANIFEST_FORMAT, Manifest

HASH = "ab" * 32


def document(chunks: list[dict], tensors: list[dict]) -> bytes:
    return msgpack.packb({
        "format": MANIFEST_FORMAT, "version": list(FORMAT_VERSION), "name": "bench", "step": 1,
        "created_ns": 1, "parent": None, "chunks": chunks, "tensors": tensors, "state": b"\x80", "user": b"\x80",
    }, use_bin_type=True)


def ordinary(target: int) -> bytes:
    """One-shard float32 tensors of 1024 elements, each one piece of a 4 MiB pack."""
    count = target // 120
    packs = count // 1000 + 1
    chunks = [{"hash": f"{i:064x}", "codec": "none", "size": 4 * 2**20, "stored_size": 4 * 2**20} for i in range(packs)]
    tensors = [{
        "key": f"model/layers.{i}.weight", "dtype": "float32", "shape": [1024], "kind": "tensor",
        "requires_grad": False,
        "shards": [{"offsets": [0], "shape": [1024], "rank": 0, "pieces": [[i // 1000, (i % 1000) * 4096, 4096]]}],
    } for i in range(count)]
    return document(chunks, tensors)


def empty_pieces(target: int) -> bytes:
    """An empty tensor whose single shard lists zero-length pieces (4 bytes each)."""
    chunks = [{"hash": HASH, "codec": "none", "size": 1, "stored_size": 1}]
    pieces = [[0, 0, 0]] * (target // 4)
    return document(chunks, [{"key": "empty", "dtype": "uint8", "shape": [0], "shards": [
        {"offsets": [0], "shape": [0], "pieces": pieces}]}])


def bricks(target: int, dims: int = 64, rows: int = 16, columns: int = 16) -> bytes:
    """Tensors of rows x columns shards in the last two of ``dims`` dimensions, each row shifted."""
    width = 1 << 16
    shape = [1] * (dims - 2) + [rows, columns * width]
    chunks = [{"hash": HASH, "codec": "none", "size": width, "stored_size": width}]
    shards = []
    for r in range(rows):
        cuts = [0] + [c * width + (r * 97) % width for c in range(1, columns)] + [columns * width]
        for start, end in zip(cuts, cuts[1:]):
            length = end - start
            pieces = [[0, 0, width]] * (length // width) + ([[0, 0, length % width]] if length % width else [])
            shards.append({"offsets": [0] * (dims - 2) + [r, start], "shape": [1] * (dims - 2) + [1, length],
                           "pieces": pieces})
    one = {"dtype": "uint8", "shape": shape, "shards": shards}
    size = len(msgpack.packb(one, use_bin_type=True)) + 20
    return document(chunks, [{"key": f"t{i}", **one} for i in range(max(1, target // size))])


BUILDERS = {"ordinary": ordinary, "empty pieces": empty_pieces, "bricks": bricks}


def parse(name: str, data: bytes) -> str:
    try:
        return f"{len(Manifest.from_bytes(data, name).tensors)} tensors"
    except ManifestError as exc:
        return f"refused: {str(exc)[:70]}"


def measure(name: str, data: bytes, memory: bool, repeats: int) -> None:
    """Time ``repeats`` parses untraced, then (with ``memory``) trace one more for its peak allocations."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        outcome = parse(name, data)
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    mib = len(data) / 2**20
    line = (f"{name:14} {mib:7.1f} MiB  {seconds:7.2f} s ({min(times):.2f}-{max(times):.2f})  "
            f"{seconds / mib * 1e3:7.1f} ms/MiB  ")
    if memory:
        tracemalloc.start()
        parse(name, data)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        line += f"peak {peak / 2**20:7.0f} MiB ({peak / len(data):4.1f} x)  "
    print(line + outcome, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=16, help="size of each manifest (MiB)")
    parser.add_argument("--only", choices=sorted(BUILDERS), help="measure one kind of manifest")
    parser.add_argument("--repeats", type=int, default=1, help="parses timed of each manifest (median, range)")
    parser.add_argument("--no-memory", action="store_true", help="skip the (slow) traced second parse")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    target = int(args.mib * 2**20)
    for name, build in BUILDERS.items():
        if args.only in (None, name):
            measure(name, build(target), not args.no_memory, args.repeats)


if __name__ == "__main__":
    main()
