"""A manifest for thousands of ranks: size, parse, open, show and ls, against DCP's ``.metadata``.

    python bench/manifest_scale.py [--tensors 2000] [--ranks 1024] [--repeats 5] [--legacy]

Builds the manifest a collective save of a ``--tensors``-tensor bf16 model
row-sharded over ``--ranks`` ranks writes (shapes of a Llama block: 4096 x 4096
attention, 11008 x 4096 MLP, 4096 norms; rows split as DTensor splits them, so
an 11008-row tensor has 1001 non-empty shards on 1024 ranks), with each rank's
shards packed into its own 4 MiB packs and the run metadata of every rank (RNG
state, environment, host, save phases). No tensor bytes are written: the
manifest is what is measured. Then, each repeated ``--repeats`` times, median
and range:

- its size, and the size of DCP's pickled ``Metadata`` for the same shards;
- msgpack's own ``unpackb`` of its bytes against ``Manifest.from_bytes`` (both
  with the cyclic collector paused, as the reader does), and ``pickle.loads`` of
  DCP's metadata, which is what DCP's ``FileSystemReader.read_metadata`` does;
- ``ckptfmt.open``, ``ckptfmt show`` and ``ckptfmt ls`` of the committed
  checkpoint, each in a fresh process: the call (ckptfmt imported first), and
  for the two commands the whole command too (Python, imports and all);
- one rank's resharding plan (the cells its boxes overlap, every tensor) at half
  the world size, from the grid's columns and, for reference, by scanning every
  shard as the one-map-per-shard form must.

``--legacy`` also writes and parses the same shards as one map each (format 1.5's
only form): minutes, and gigabytes of memory.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import torch

from ckptfmt.format.manifest import Chunk, Manifest, TensorEntry
from ckptfmt.format.shards import ShardGrid
from ckptfmt.format.values import TensorRef, encode_tree
from ckptfmt.metadata.environment import capture_environment
from ckptfmt.metadata.rng import capture_rng
from ckptfmt.repository.leases import save_lease
from ckptfmt.repository.repository import Repository
from ckptfmt.saving.core import commit_manifest

BLOCK = [(4096, 4096)] * 4 + [(11008, 4096)] * 3 + [(4096,)] * 2
PACK, SMALL, ALIGN, WIDTH = 4 * 2**20, 256 * 2**10, 64, 2


def row_splits(rows: int, ranks: int) -> list[tuple[int, int]]:
    """Each rank's rows [start, end) as DTensor's Shard(0) (torch.chunk) splits them; trailing ranks may get none."""
    step = -(-rows // ranks)
    return [(min(r * step, rows), min((r + 1) * step, rows)) for r in range(ranks)]


def build(tensors: int, ranks: int) -> tuple[Manifest, list[tuple]]:
    """The manifest, and the layout (key, shape, rank splits) that DCP's metadata is built from."""
    shapes = [BLOCK[i % len(BLOCK)] for i in range(tensors)]
    keys = [f"model.layers.{i // len(BLOCK)}.w{i % len(BLOCK)}" for i in range(tensors)]
    splits = [row_splits(shape[0], ranks) for shape in shapes]
    row_bytes = [int(np.prod(shape[1:], dtype=np.int64)) * WIDTH for shape in shapes]
    chunk_of = np.zeros((tensors, ranks), dtype=np.int64)
    offset_of = np.zeros((tensors, ranks), dtype=np.int64)
    chunks: list[Chunk] = []
    for rank in range(ranks):  # each rank packs its shards, tensor by tensor, into 4 MiB packs (spec 5.2)
        pack, end = -1, PACK
        for t in range(tensors):
            start, stop = splits[t][rank]
            size = (stop - start) * row_bytes[t]
            if not size:
                continue
            if size >= SMALL:  # a chunk of its own (fewer ranks: bigger shards)
                chunks.append(Chunk(f"{len(chunks):064x}", "none", size, size))
                chunk_of[t, rank], offset_of[t, rank] = len(chunks) - 1, 0
                continue
            at = -(-end // ALIGN) * ALIGN
            if at + size > PACK:
                pack, at = len(chunks), 0
                chunks.append(Chunk(f"{pack:064x}", "none", 0, 0))
            chunk_of[t, rank], offset_of[t, rank], end = pack, at, at + size
            chunks[pack] = chunks[pack]._replace(size=end, stored_size=end)
    entries = []
    for t, (key, shape) in enumerate(zip(keys, shapes)):
        held = np.array([stop > start for start, stop in splits[t]])
        cuts = [np.array([0] + [stop for (start, stop), h in zip(splits[t], held) if h], dtype=np.int64)]
        cuts += [np.array([0, extent], dtype=np.int64) for extent in shape[1:]]
        owners = np.flatnonzero(held)
        lengths = np.array([(stop - start) * row_bytes[t] for start, stop in splits[t]])[owners]
        grid = ShardGrid(cuts, owners, np.arange(len(owners) + 1), chunk_of[t, owners], offset_of[t, owners],
                         lengths)
        entries.append(TensorEntry(key, "bfloat16", shape, grid, kind="parameter", requires_grad=True))
    index = {key: i for i, key in enumerate(keys)}
    state = encode_tree({"model": {key: TensorRef(key) for key in keys}, "step": 1000},
                        lambda path, ref: index[ref.key])
    now = time.time_ns()
    manifest = Manifest(
        name="step-1000", step=1000, created_ns=now, parent=None, chunks=chunks, tensors=entries,
        state=state, user=encode_tree({}),
        rng=[capture_rng(rank) for rank in range(ranks)],
        environment={**capture_environment(), "ranks": list(range(ranks))},
        topology={"world_size": ranks, "writer_ranks": list(range(ranks)),
                  "ranks": [{"rank": r, "host": f"node{r // 8:04d}", "local_rank": r % 8} for r in range(ranks)]},
        timing={"ranks": [{"rank": r, "host": f"node{r // 8:04d}", "start_ns": now, "total_s": 1.0,
                           "phases": [{"name": p, "start_ns": now, "duration_s": 0.1} for p in
                                      ("join", "prepare", "plan", "write_chunks", "sync", "environment")]}
                          for r in range(ranks)]},
        totals={"tensor_count": tensors, "chunk_count": len(chunks)},
    )
    return manifest, list(zip(keys, shapes, splits, chunk_of, offset_of))


def dcp_metadata(layout: list[tuple]) -> bytes:
    """DCP's ``.metadata`` for the same shards, as its FileSystemWriter pickles it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state, storage = {}, {}
    for key, shape, splits, _chunk_of, offset_of in layout:
        boxes = []
        for rank, (start, stop) in enumerate(splits):
            if stop == start:
                continue
            offsets, sizes = torch.Size([start, *[0] * (len(shape) - 1)]), torch.Size([stop - start, *shape[1:]])
            boxes.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            length = (stop - start) * int(np.prod(shape[1:], dtype=np.int64)) * WIDTH
            storage[MetadataIndex(key, offsets, len(boxes) - 1)] = _StorageInfo(
                f"__{rank}_0.distcp", int(offset_of[rank]), length)
        state[key] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size(shape), boxes)
    return pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage))


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of ``fn`` per repeat, the cyclic collector paused and a collection before each."""
    times = []
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return times


CLI = [sys.executable, "-m", "ckptfmt.cli"]


def call_seconds(call: str, repeats: int) -> list[float]:
    """Seconds of ``call`` (ckptfmt and the CLI's ``main`` imported first, untimed), each in a fresh
    process, its standard output discarded."""
    code = ("import os, sys, time, ckptfmt\nfrom ckptfmt.cli import main\nsys.stdout = open(os.devnull, 'w')\n"
            f"start = time.perf_counter()\n{call}\nsys.stderr.write(repr(time.perf_counter() - start))")
    return [float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stderr)
            for _ in range(repeats)]


def command_seconds(argv: list[str], repeats: int) -> list[float]:
    """Wall seconds of a fresh process per repeat (its output discarded)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times


def spread(values: list[float], unit: str = "s", scale: float = 1.0) -> str:
    low, mid, high = min(values) * scale, statistics.median(values) * scale, max(values) * scale
    return f"{mid:.3f} {unit} (range {low:.3f}-{high:.3f})"


def plan_one_rank(manifest: Manifest, ranks: int, rank: int, by_scan: bool) -> int:
    """How many saved shards rank ``rank`` of a world of ``ranks`` reads, its boxes split as DTensor splits."""
    cells = 0
    for entry in manifest.tensors:
        step = -(-entry.shape[0] // ranks)  # rank's rows as row_splits gives them
        start, stop = min(rank * step, entry.shape[0]), min((rank + 1) * step, entry.shape[0])
        offsets, shape = (start, *[0] * (len(entry.shape) - 1)), (stop - start, *entry.shape[1:])
        if not by_scan:
            cells += len(entry.shards.overlapping(offsets, shape))
            continue
        for shard in entry.shards:  # what a list of shard maps leaves: look at every one
            if all(o < s + m and s < o + n for o, n, s, m in zip(offsets, shape, shard.offsets, shard.shape)):
                cells += 1
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--legacy", action="store_true", help="also measure one map per shard (slow)")
    args = parser.parse_args()

    started = time.perf_counter()
    manifest, layout = build(args.tensors, args.ranks)
    shards = sum(len(t.shards) for t in manifest.tensors)
    data = manifest.to_bytes()
    metadata = dcp_metadata(layout)
    print(f"{args.tensors} tensors x {args.ranks} ranks: {shards:,} shards, {len(manifest.chunks):,} chunks "
          f"(built in {time.perf_counter() - started:.0f} s)")
    print(f"manifest    {len(data) / 1e6:7.1f} MB  ({len(data) / shards:.1f} bytes a shard, run metadata included)")
    print(f"DCP         {len(metadata) / 1e6:7.1f} MB  (.metadata: pickled Metadata)")

    unpack = timed(lambda: msgpack.unpackb(data, raw=False, strict_map_key=False), args.repeats)
    parse = timed(lambda: Manifest.from_bytes(data, "bench"), args.repeats)
    unpickle = timed(lambda: pickle.loads(metadata), args.repeats)
    ratios = [p / u for p, u in zip(parse, unpack)]
    print(f"msgpack unpackb      {spread(unpack)}")
    print(f"Manifest.from_bytes  {spread(parse)}; per repeat {spread(ratios, 'x')} of unpackb")
    print(f"DCP pickle.loads     {spread(unpickle)}")

    root = Path(tempfile.mkdtemp(prefix="ckptfmt-scale-"))
    try:
        repo = Repository.open(str(root / "repo"), create=True)
        with save_lease(repo) as lease:
            commit_manifest(repo, manifest, lease)
        url = str(root / "repo" / manifest.name)
        repo_url = str(root / "repo")
        print(f"ckptfmt.open         {spread(call_seconds(f'ckptfmt.open({url!r})', args.repeats))}")
        for command, target in (("show", url), ("ls", repo_url)):
            call = spread(call_seconds(f"main([{command!r}, {target!r}])", args.repeats))
            whole = spread(command_seconds([*CLI, command, target], args.repeats))
            print(f"ckptfmt {command:12} {call}; whole command {whole}")
        noop = command_seconds([sys.executable, "-c", "import ckptfmt.cli"], args.repeats)
        print(f"  python + import ckptfmt.cli: {spread(noop)} (torch is not imported by it)")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    parsed = Manifest.from_bytes(data, "bench")
    half = args.ranks // 2
    plan = timed(lambda: plan_one_rank(parsed, half, 1, by_scan=False), args.repeats)
    scan = timed(lambda: plan_one_rank(parsed, half, 1, by_scan=True), 1)
    print(f"resharding plan, one rank of {half}: {spread(plan)} from the columns "
          f"({plan_one_rank(parsed, half, 1, False):,} cells); {scan[0]:.2f} s scanning every shard")

    if args.legacy:
        doc = manifest.to_dict()
        for entry, tensor in zip(doc["tensors"], manifest.tensors):
            entry["shards"] = [{"offsets": list(s.offsets), "shape": list(s.shape), "rank": s.rank,
                                "pieces": [list(p) for p in s.pieces]} for s in tensor.shards]
        legacy = msgpack.packb(doc, use_bin_type=True)
        del doc
        unpack = timed(lambda: msgpack.unpackb(legacy, raw=False, strict_map_key=False), 1)
        parse = timed(lambda: Manifest.from_bytes(legacy, "bench"), 1)
        print(f"one map per shard: {len(legacy) / 1e6:.1f} MB; unpackb {unpack[0]:.2f} s, "
              f"Manifest.from_bytes {parse[0]:.2f} s ({parse[0] / unpack[0]:.1f}x)")


if __name__ == "__main__":
    main()
