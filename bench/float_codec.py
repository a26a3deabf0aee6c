"""The float codec (``float-zstd``, format 1.11) beside ZipNN and ckptfmt's shuffle-zstd, on real
training state: ratio, and compress/decompress GB/s on one core.

Usage (from the repository root)::

    python bench/float_codec.py [--steps 200] [--bf16-steps 100] [--dim 384] [--layers 4] [--repeats 7]

bench/delta.py's byte-level GPT trains on ckptfmt's own source with AdamW, on one thread, for
``--steps`` steps in fp32 and ``--bf16-steps`` in bf16 (weights and AdamW moments bf16). For each
dtype, the weights, ``exp_avg`` and ``exp_avg_sq`` are each one buffer (the tensors concatenated,
as a chunk of them would be), and each codec encodes and decodes each buffer ``--repeats`` times,
the codecs' order reversed every other repeat. Codecs:

- ``float``: ckptfmt's ``floatN-zstd`` (``compression="float-zstd"``);
- ``shuffle``: ckptfmt's ``shuffleN-zstd`` (``compression="shuffle-zstd"``);
- ``zipnn``: ZipNN (``pip install zipnn``; a bench dependency), one thread, its defaults
  otherwise. ZipNN writes into the buffer it compresses (even a ``bytes`` object), so it is given a
  fresh copy each time, made before its clock starts;
- ``delta``/``fdelta``: the final state stored against the state 10 steps earlier, as
  ``deltaN-zstd`` (XOR, shuffle, zstd) and ``floatdeltaN-zstd`` (XOR, then the float codec's planes);
- ``auto``/``autodelta``: what ``compression="auto"`` chooses for a chunk of floats, whole (the float
  codec or the shuffle) and as a delta (either delta), by a sample; the sample's cost is in the time.

Prints, per dtype and buffer, each codec's ratio (original / stored), compress and decompress GB/s
of original bytes (median and range over the repeats), and the median, over the repeats, of the
float codec's speed divided by ZipNN's in the same repeat. Every decode is checked bit for bit.

Then the state as a user saves it: the final model's ``state_dict()`` and AdamW's, through
``ckptfmt.save`` with each ``compression``, the ratio of its tensors' bytes to the chunks stored.
With ``--dim 128`` every tensor is under 256 KiB, so every one is in a pack (spec 5.2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from delta import _cloned, training

import ckptfmt
from ckptfmt.format import codecs


def train(dtype: torch.dtype, steps: int, dim: int, layers: int) -> tuple[dict, dict, dict]:
    """The run's (state 10 steps before the end, final state): {"weights", "exp_avg", "exp_avg_sq"}
    as one flat tensor each; and the final state as saved: {"model": state_dict, "optim": AdamW's}."""
    kept, saved = {}, {}
    for step, model, optimizer in training(dtype, steps, dim, layers):
        if step in (steps - 10, steps):
            moments = optimizer.state.values()
            kept[step] = {
                "weights": torch.cat([p.detach().flatten() for p in model.parameters()]),
                "exp_avg": torch.cat([s["exp_avg"].flatten() for s in moments]),
                "exp_avg_sq": torch.cat([s["exp_avg_sq"].flatten() for s in moments]),
            }
        if step == steps:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "optim": _cloned(optimizer.state_dict())}
    return kept[steps - 10], kept[steps], saved


def saved_ratios(state: dict) -> tuple[dict[str, tuple[float, int]], int]:
    """compression -> (tensor bytes / stored chunk bytes, chunks) of ``state`` saved with it; and the
    largest tensor's bytes."""
    tensors = [v for part in state.values() for v in part.values() if isinstance(v, torch.Tensor)] + [
        v for entry in state["optim"]["state"].values() for v in entry.values() if isinstance(v, torch.Tensor)]
    original = sum(t.numel() * t.element_size() for t in tensors)
    ratios = {}
    with tempfile.TemporaryDirectory(prefix="ckptfmt-bench-float-") as root:
        for compression in ("shuffle-zstd", "float-zstd", "auto"):
            url = f"{root}/{compression}/step-1"
            ckptfmt.save(state, url, compression=compression)
            with ckptfmt.open(url) as reader:
                chunks = reader.manifest.chunks
                ratios[compression] = (original / sum(c.stored_size for c in chunks), len(chunks))
            loaded = ckptfmt.load(url)
            if not all(torch.equal(a, b) for a, b in zip(loaded["model"].values(), state["model"].values())):
                raise AssertionError(f"{compression} did not load the model bit for bit")
    return ratios, max(t.numel() * t.element_size() for t in tensors)


def _zipnn(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    try:
        from zipnn import ZipNN
    except ImportError:
        return None
    return ZipNN(input_format="byte", bytearray_dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
                 threads=1)


def codec_runs(dtype: torch.dtype, data: bytes, base: bytes) -> dict:
    """name -> (prepare() -> input, encode(input) -> stored, decode(stored) -> bytes); only encode and
    decode are timed."""
    width = torch.empty(0, dtype=dtype).element_size()
    runs = {}
    for name, codec, against in (("float", f"float{width}-zstd", None), ("shuffle", f"shuffle{width}-zstd", None),
                                 ("delta", f"delta{width}-zstd", base), ("fdelta", f"floatdelta{width}-zstd", base)):
        runs[name] = (lambda: memoryview(data),
                      lambda view, c=codec, b=against: codecs.encode(c, view, b),
                      lambda stored, c=codec, b=against: codecs.decode(c, stored, len(data), "bench", b))
    # compression="auto"'s choice for a chunk of floats: the float codec or the shuffle (whole), the float
    # delta or the XOR-shuffle delta, whichever stores a sample smaller (the sample's cost is timed).
    for name, pair, against in (("auto", [f"float{width}-zstd", f"shuffle{width}-zstd"], None),
                                ("autodelta", [f"floatdelta{width}-zstd", f"delta{width}-zstd"], base)):
        chosen: dict[str, str] = {}

        def auto_encode(view, pair=pair, b=against, chosen=chosen):  # type: ignore[no-untyped-def]
            chosen["codec"] = codecs.smaller_on_sample(pair, view, b)
            return codecs.encode(chosen["codec"], view, b)

        runs[name] = (lambda: memoryview(data), auto_encode,
                      lambda stored, b=against, chosen=chosen: codecs.decode(chosen["codec"], stored, len(data),
                                                                            "bench", b))
    zipnn = _zipnn(dtype)
    if zipnn is not None:  # ZipNN writes into what it compresses: a fresh copy each time
        runs["zipnn"] = (lambda: bytearray(data), zipnn.compress, zipnn.decompress)
    return runs


def measure(dtype: torch.dtype, data: bytes, base: bytes, repeats: int) -> dict:
    runs = codec_runs(dtype, data, base)
    names = list(runs)
    results: dict[str, dict[str, list[float]]] = {n: {"ratio": [], "enc": [], "dec": []} for n in names}
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else reversed(names):
            prepare, encode, decode = runs[name]
            given = prepare()
            start = time.perf_counter()
            stored = encode(given)
            enc = time.perf_counter() - start
            stored = bytes(stored)
            start = time.perf_counter()
            decoded = decode(stored)
            dec = time.perf_counter() - start
            if bytes(decoded) != data:
                raise AssertionError(f"{name} did not decode {dtype} bit for bit")
            results[name]["ratio"].append(len(data) / len(stored))
            results[name]["enc"].append(len(data) / enc / 1e9)
            results[name]["dec"].append(len(data) / dec / 1e9)
    return results


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--bf16-steps", type=int, default=100)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    totals: dict[tuple[str, str], list[int]] = {}
    saves = []
    for dtype, steps in ((torch.bfloat16, args.bf16_steps), (torch.float32, args.steps)):
        before, after, state = train(dtype, steps, args.dim, args.layers)
        saves.append((str(dtype).removeprefix("torch."), saved_ratios(state)))
        for part in ("weights", "exp_avg", "exp_avg_sq"):
            data = after[part].contiguous().view(torch.uint8).numpy().tobytes()
            base = before[part].contiguous().view(torch.uint8).numpy().tobytes()
            results = measure(dtype, data, base, args.repeats)
            for name, r in results.items():
                stored = len(data) / statistics.median(r["ratio"])
                totals.setdefault((str(dtype).removeprefix("torch."), name), [0, 0])
                totals[(str(dtype).removeprefix("torch."), name)][0] += len(data)
                totals[(str(dtype).removeprefix("torch."), name)][1] += int(stored)
                versus = ""
                if "zipnn" in results and name == "float":
                    zipnn = results["zipnn"]
                    versus = (f"enc {_spread([a / b for a, b in zip(r['enc'], zipnn['enc'])])}, "
                              f"dec {_spread([a / b for a, b in zip(r['dec'], zipnn['dec'])])}")
                rows.append((str(dtype).removeprefix("torch."), part, f"{len(data) / 1e6:.1f}", name,
                             f"{statistics.median(r['ratio']):.3f}", _spread(r["enc"]), _spread(r["dec"]), versus))
    header = ("dtype", "buffer", "MB", "codec", "ratio", "compress GB/s", "decompress GB/s", "float / zipnn speed")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    print("\nAll three buffers together (ratio of the sums):")
    for (dtype_name, name), (original, stored) in totals.items():
        print(f"  {dtype_name:8} {name:8} {original / stored:.3f}")
    print("\nThe state saved (model and AdamW state dicts), tensor bytes / stored chunk bytes:")
    for dtype_name, (ratios, largest) in saves:
        zipnn = totals.get((dtype_name, "zipnn"))
        against = f"; ZipNN on the three buffers {zipnn[0] / zipnn[1]:.3f}" if zipnn else ""
        shown = ", ".join(f"{c} {r:.3f}" for c, (r, _) in ratios.items())
        chunks = ratios["auto"][1]
        print(f"  {dtype_name:8} {shown}{against} ({chunks} chunks; largest tensor {largest / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
