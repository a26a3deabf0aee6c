"""The corpus writer: tests/corpus/generate.py runs it under an old tree (tests/support/old_trees.py), so
``import ckptfmt`` is the ckptfmt of the commit that introduced a format version. It saves that version's
checkpoints and prints, as JSON, what it saved (the writer's side of expected.json): each tensor hashed
here, from the tensors given to ``save``, and each plain value as it put it in.

    writer.py solo VERSION REPO KEY                 the checkpoints one process saves (KEY: the test key,
                                                    made here with this tree's keygen when missing)
    writer.py rank VERSION REPO STORE RANK WORLD    one rank of the collective save (file store STORE)

What differs between versions is SINCE (what a version can write) and nothing else: the API these
calls use (``save``'s keywords, ``Sharded``, ``PerRank``, ``SigningKey``, ``open``'s reader with
``keys()``, ``manifest.chunks`` and ``metadata``) kept its names from 1.0 to 1.15.
"""

from __future__ import annotations

import json
import math
import sys
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import typed_json

import ckptfmt

#: The first format version that writes each feature the writer uses.
SINCE = {"shards": (1, 1), "rng_argument": (1, 1), "delta_codecs": (1, 5), "signatures": (1, 7),
         "node_scope": (1, 10), "float_codecs": (1, 11), "parity": (2, 1)}
#: The format's dtypes (spec 8), all known to ckptfmt since 1.0.
DTYPES = ["bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16", "bfloat16",
          "float32", "float64", "complex32", "complex64", "complex128", "float8_e4m3fn", "float8_e4m3fnuz",
          "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8",
          "bits2x4", "bits4x2"]
#: The user metadata of every checkpoint (a value tree of its own).
METADATA = {"run": "corpus", "lr": 3e-4, "tags": ("a", "b"), "seed": 2**70}
WORLD = 2


def has(version: tuple[int, int], feature: str) -> bool:
    return version >= SINCE[feature]


# -- states ------------------------------------------------------------------------------------------------
def dtype_tensors() -> dict:
    """Six elements of every dtype: byte patterns viewed as it (NaNs with payloads, subnormals, every bit
    of the integers), bools 0 and 1."""
    out = {"bool": torch.tensor([True, False, False, True, True, False])}
    for name in DTYPES[1:]:
        dtype = getattr(torch, name)
        pattern = (torch.arange(6 * dtype.itemsize) * 37 + 11) % 256
        out[name] = pattern.to(torch.uint8).view(dtype)
    return out


def special_tensors() -> dict:
    """Floats' special values, zeros of both signs as the extremes (in both orders: writers before 1.6's
    second revision took the sign of a zero extreme from the order), integers' extremes."""
    floats = torch.tensor([0.0, -0.0, 1.5, math.nan, math.inf, -math.inf, 1e-40, -65504.0])
    ints = {name: torch.tensor([torch.iinfo(getattr(torch, name)).min, torch.iinfo(getattr(torch, name)).max, -1, 0],
                               dtype=getattr(torch, name)) for name in ("int8", "int16", "int32", "int64")}
    return {**{name: floats.to(getattr(torch, name)) for name in ("float16", "bfloat16", "float32", "float64")},
            **ints, "uint8": torch.tensor([0, 255], dtype=torch.uint8),
            "zeros": torch.tensor([0.0, -0.0]), "zeros_reversed": torch.tensor([-0.0, 0.0])}


def plain_values() -> dict:
    """A value of every kind of the value tree (spec 7)."""
    return {
        "none": None,
        "bools": [True, False],
        "ints": [0, 7, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 10**40, -(10**40)],
        "floats": [0.0, -0.0, 1.5, math.nan, math.inf, -math.inf, 5e-324, sys.float_info.max, 0.1],
        "complex": [complex(1.5, -0.0), complex(math.nan, math.inf)],
        "str": ["", "héllo ✓", "a/b%c"],
        "bytes": [b"", bytes(range(256))],
        "tuple": (1, "two", (3.0, None)),
        "empty": [[], (), {}, set(), frozenset()],
        "keys": {7: "int", -2: "negative", 2**70: "big", 2.5: "float", None: "none", True: "bool", b"k": "bytes",
                 (1, "x"): "tuple", frozenset({3}): "frozenset", "": "empty string"},
        "ordered": OrderedDict([("b", 1), ("a", 2)]),
        "sets": [{1, 2, 3}, frozenset({"x", "y"}), {(1, 2), None}],
        "torch": [torch.Size([2, 3]), torch.Size([]), torch.float32, torch.bfloat16, torch.uint64, torch.float8_e4m3fn,
                  torch.device("cpu"), torch.device("cuda", 1)],
        "numpy": [np.float32(1.5), np.float64(math.nan), np.float16(-0.0), np.int8(-5), np.uint64(2**64 - 1),
                  np.int64(-(2**63)), np.bool_(True), np.complex64(1 - 2j), np.complex128(complex(0.0, -0.0))],
        "opaque": ckptfmt.OpaqueObject("collections", "Counter", b"\x80\x04N."),
        "nested": [[[[{"deep": (1,)}]]]],
    }


def sharded_tensors() -> dict:
    """Tensors given as shards (format 1.1): split by rows, a 2x2 grid (a shard grid from 1.6), and
    shards that form no grid (kept one map each)."""
    shard = ckptfmt.Shard
    rows, grid, odd = torch.arange(15.0).reshape(5, 3), torch.arange(24.0).reshape(4, 6), torch.arange(16).reshape(4, 4)
    return {
        "rows": ckptfmt.Sharded((5, 3), [shard((0, 0), rows[:3], 0), shard((3, 0), rows[3:], 1)]),
        "grid": ckptfmt.Sharded((4, 6), [shard((r, c), grid[r:r + 2, c:c + 3].clone(), r + c // 3)
                                         for r in (0, 2) for c in (0, 3)]),
        "irregular": ckptfmt.Sharded((4, 4), [shard((0, 0), odd[:2], 0), shard((2, 0), odd[2:, :1].clone(), 1),
                                              shard((2, 1), odd[2:, 1:].clone(), 2)]),
    }


def values_state(version: tuple[int, int]) -> dict:
    """Every dtype, layout and kind of tensor and every plain value this version stores, in one state."""
    tied = torch.linspace(-1, 1, 5)
    state = {
        "dtypes": dtype_tensors(),
        "special": special_tensors(),
        "layouts": {"scalar": torch.tensor(2.5), "empty": torch.empty(0, 3), "3d": torch.arange(24).reshape(2, 3, 4),
                    "transposed": torch.arange(12.0).reshape(3, 4).t()},
        "tied": {"a": tied, "b": tied},
        "kinds": {"parameter": torch.nn.Parameter(torch.ones(3)),
                  "frozen": torch.nn.Parameter(torch.zeros(2), requires_grad=False),
                  "requires_grad": torch.ones(2).requires_grad_(), "numpy": np.arange(6, dtype=np.int32).reshape(2, 3),
                  "numpy_f8": np.array([0.5, -0.0, np.nan])},
        "paths": {"a/b%c": torch.ones(1), 3: torch.zeros(1), (1, "x"): torch.full((1,), 2.0)},
        "layers": [torch.eye(2), torch.eye(3)],
        "values": plain_values(),
        "step": 1,
    }
    if has(version, "shards"):
        state["sharded"] = sharded_tensors()
        state["loader"] = ckptfmt.PerRank({"position": 3, "epoch": 1})
    return state


#: The bits a changed tensor flips in an element (as an int of its width): two on either side of a byte
#: boundary, in the exponent of a float (its bits 0-1 in bf16 and fp32, 3-4 in fp64). A float codec's
#: rotation puts both in one byte plane where the shuffle splits them over two, so the float delta codec
#: stores the change smaller, and 1.12's "auto", which picks the smaller, picks it.
FLIPS = {"uint8": (torch.uint8, 0b11), "bfloat16": (torch.int16, 0b11 << 7), "float32": (torch.int32, 0b11 << 23),
         "float64": (torch.int64, 0b11 << 55)}


def big_tensors(changed: bool) -> dict:
    """Four tensors of 256 KiB (smaller ones are packed, spec 5.2), one per element width, repeating 512
    values of 64 kinds: every codec stores each in about 1 KB. ``changed``: one element in 200 has FLIPS
    flipped (what a delta checkpoint stores: the XOR with its parent's is mostly zeros)."""
    pattern = torch.randint(-32, 32, (512,), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, count in (("uint8", 262144), ("bfloat16", 131072), ("float32", 65536), ("float64", 32768)):
        values = pattern.repeat(count // 512)
        tensor = (values % 256).to(torch.uint8) if name == "uint8" else (values * 0.125).to(getattr(torch, name))
        if changed:
            as_int, bits = FLIPS[name]
            moved = torch.randperm(count, generator=torch.Generator().manual_seed(2))[:count // 200]
            tensor.view(as_int)[moved] ^= bits
        out[name] = tensor
    return out


def codec_state(changed: bool, step: int) -> dict:
    """The state of the codec checkpoints: the big tensors and a small one (packed)."""
    return {"big": big_tensors(changed), "small": torch.arange(10.0), "step": step}


def collective_state(rank: int) -> tuple[dict, dict]:
    """A rank's part of the collective save (a replicated tensor, DTensors sharded by rows and by
    columns, a per-rank value), and the state a load of it gives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    generator = torch.Generator().manual_seed(1)
    full = {"rows": torch.randn(6, 4, generator=generator), "cols": torch.randn(4, 6, generator=generator)}
    replicated = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    state = {"model": {"replicated": replicated, "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
                       "cols": distribute_tensor(full["cols"], mesh, [Shard(1)])},
             "loader": ckptfmt.PerRank({"position": 100 * rank}), "step": 6}
    loaded = {"model": {"replicated": replicated, **full},
              "loader": ckptfmt.PerRankValues({r: {"position": 100 * r} for r in range(WORLD)}), "step": 6}
    return state, loaded


# -- what a state gives back ---------------------------------------------------------------------------------
def as_loaded(value):
    """What a single-process load returns for ``value``: sharded tensors whole (assembled here from the
    shards saved), a ``PerRank`` value as rank 0's; the same tensor objects otherwise (ties stay ties)."""
    if type(value) in (dict, OrderedDict):
        return type(value)((key, as_loaded(item)) for key, item in value.items())
    if type(value) in (list, tuple):
        return type(value)(as_loaded(item) for item in value)
    if type(value).__name__ == "Sharded":
        whole = torch.zeros(value.shape, dtype=value.shards[0].tensor.dtype)
        for shard in value.shards:
            whole[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.tensor.shape))] = shard.tensor
        return whole
    if type(value).__name__ == "PerRank":
        return ckptfmt.PerRankValues({0: value.value})
    return value


def describe(url: str, loaded: dict, key_id: str | None = None) -> dict:
    """What checkpoint ``url`` holds, from this writer's side: tensors hashed from ``loaded`` (a tensor
    given twice is ``same_as`` its first key), its codecs and step as this tree's reader lists them."""
    with ckptfmt.open(url) as reader:
        keys = reader.keys()
        codecs = sorted({chunk.codec for chunk in reader.manifest.chunks})
        meta = reader.metadata
    found: dict = {}
    state = typed_json.encode(loaded, found)
    if sorted(found) != sorted(keys):
        raise SystemExit(f"{url}: the reader lists {sorted(keys)}, the state has {sorted(found)}")
    tensors, first = {}, {}
    for key in keys:
        tensors[key] = typed_json.describe_tensor(found[key])
        if id(found[key]) in first:
            tensors[key]["same_as"] = first[id(found[key])]
        first.setdefault(id(found[key]), key)
    signatures = sorted(p.name[len("signature-"):-len(".json")] for p in Path(url).glob("signature-*.json"))
    if signatures != ([key_id] if key_id else []):
        raise SystemExit(f"{url}: signatures {signatures}, signed with {key_id}")
    return {"step": meta["step"], "format_version": meta["format_version"], "codecs": codecs, "signed_by": key_id,
            "tensors": tensors, "state": state, "metadata": typed_json.encode(METADATA)}


# -- the two modes ---------------------------------------------------------------------------------------------
def signing_key(path: Path):
    """The corpus's test key (``ckptfmt.generate_key`` of this tree makes it when missing)."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        ckptfmt.generate_key(path)
    return ckptfmt.SigningKey(load_pem_private_key(path.read_bytes(), None), signer="ckptfmt corpus test key")


def solo(version: tuple[int, int], repo: str, key: Path) -> dict:
    """One process's checkpoints: every value (signed where the version signs), then one per codec."""
    out = {}

    def save(name: str, state: dict, step: int, compression: str | None, **options) -> None:
        url = ckptfmt.save(state, f"{repo}/{name}", step=step, metadata=METADATA, compression=compression, **options)
        out[name] = describe(url, as_loaded(state), options["signer"].key_id if "signer" in options else None)

    signed = {"signer": signing_key(key)} if has(version, "signatures") else {}
    if has(version, "parity"):  # the values' checkpoint carries parity: its chunks rebuild from what this writer wrote
        signed["parity"] = "2+1"
    # Checkpoints but the first hold no RNG states, as an import's (10 KB a manifest saved), where save takes rng=.
    no_rng = {"rng": []} if has(version, "rng_argument") else {}
    save("values", values_state(version), 1, None, **signed)
    save("shuffle", codec_state(False, 2), 2, "shuffle-zstd", **no_rng)  # zstd for 1-byte elements and packs
    if has(version, "delta_codecs"):
        save("delta", codec_state(True, 3), 3, "delta-zstd", **no_rng)  # against "shuffle", the latest
    if has(version, "float_codecs"):
        save("float", codec_state(False, 4), 4, "float-zstd", **no_rng)
        save("float-delta", codec_state(True, 5), 5, "auto", **no_rng)  # floatdelta against "float"
    return {"checkpoints": out, "ranks": WORLD if has(version, "shards") else 0}


def one_rank(version: tuple[int, int], repo: str, store: str, rank: int, world: int) -> dict:
    """This rank's part of the collective saves (no RNG states either); rank 0 describes them."""
    import torch.distributed as dist

    assert world == WORLD
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    state, loaded = collective_state(rank)
    out = {}
    for name, step, options in (("collective", 6, {}), ("node", 7, {"scope": "node"})):
        if name == "node" and not has(version, "node_scope"):
            continue
        url = ckptfmt.save(state, f"{repo}/{name}", step=step, metadata=METADATA, timeout=60, rng=[], **options)
        if rank == 0:
            out[name] = describe(url, loaded)
    dist.destroy_process_group()
    return {"checkpoints": out}


def main() -> None:
    mode, version, repo, *rest = sys.argv[1:]
    numbers = tuple(int(n) for n in version.split("."))
    if tuple(ckptfmt.FORMAT_VERSION) != numbers:
        raise SystemExit(f"this tree writes format {ckptfmt.FORMAT_VERSION}, not {version}")
    if mode == "solo":
        result = solo(numbers, repo, Path(rest[0]))
    else:
        result = one_rank(numbers, repo, rest[0], *map(int, rest[1:]))
    sys.stdout.write(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
