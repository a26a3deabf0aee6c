"""The float codecs (format 1.11, spec 5.3): ``floatN-zstd`` and their delta form ``floatdeltaN-zstd``.

Round trips are bit-exact over every special value (NaN payloads, infinities, -0.0, subnormals) and
every tail length; neither direction writes into its input or hands out memory that aliases it;
damaged, truncated and lying stored bytes raise CorruptDataError naming the chunk, and decode
allocates no more than the chunk's size; saves with ``compression="float-zstd"`` and ``"auto"`` store
floating-point tensors with them, load bit for bit and verify.
"""

from __future__ import annotations

import hashlib
import time
import tracemalloc

import numpy as np
import pytest
import torch
import zstandard

import ckptfmt
from ckptfmt.errors import CorruptDataError, ManifestError
from ckptfmt.format import codecs
from tests.support.spec_reader import SpecReader

FLOATS = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.float64: 8}


def _special_values(dtype: torch.dtype, n: int = 4099) -> bytes:
    """``n`` elements: random normals over many magnitudes, then every special value's bit patterns."""
    gen = torch.Generator().manual_seed(11)
    values = (torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-30, 30, (n,),
                                                                                         generator=gen)).to(dtype)
    width = FLOATS[dtype]
    bits = values.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[width]).clone()
    info = torch.finfo(dtype)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.tiny, -info.tiny,
                             info.tiny / 4, -info.smallest_normal / 8, info.max, -info.max], dtype=dtype)
    bits[: len(specials)] = specials.view(bits.dtype)
    # NaNs with payloads, signalling and quiet, of both signs: all exponent bits set, mantissa != 0.
    top = 8 * width - 1
    exponent_bits = {torch.bfloat16: 8, torch.float16: 5, torch.float32: 8, torch.float64: 11}[dtype]
    all_ones = ((1 << exponent_bits) - 1) << (top - exponent_bits)
    for i, payload in enumerate((1, 2, 3, (1 << (top - exponent_bits)) - 1)):
        for sign in (0, 1):
            pattern = all_ones | payload | (sign << top)
            bits[20 + 2 * i + sign] = pattern - (1 << (top + 1)) if pattern >= 1 << top else pattern
    return bits.numpy().tobytes()


@pytest.mark.parametrize("dtype", list(FLOATS), ids=str)
@pytest.mark.parametrize("tail", [0, 1, 3, 7])
def test_round_trips_bit_exactly_over_special_values_and_tails(dtype, tail):
    width = FLOATS[dtype]
    data = _special_values(dtype) + bytes(range(251, 251 - tail, -1))
    for codec in (f"float{width}-zstd", f"floatdelta{width}-zstd"):
        base = bytes(reversed(data)) if codecs.is_delta(codec) else None
        stored = codecs.encode(codec, memoryview(data), base)
        decoded = codecs.decode(codec, bytes(stored), len(data), "chunk x", base)
        assert bytes(decoded) == data, codec


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("size", [0, 1, 2, 3, 5, 8, 9, 17])
def test_tiny_and_empty_chunks_round_trip(width, size):
    data = bytes((7 * i + 1) % 256 for i in range(size))
    stored = codecs.encode(f"float{width}-zstd", memoryview(data))
    assert len(stored) == 8 * width + size  # nothing compresses: every plane raw, lengths in the header
    assert bytes(codecs.decode(f"float{width}-zstd", bytes(stored), size, "x")) == data


def test_the_layout_is_the_specs():
    """Header of N little-endian uint64 plane lengths; planes of the rotated elements; the tail unchanged.
    bf16 1.0 is 0x3f80: rotated left by one bit 0x7f00, so plane 0 (low bytes) is 00, plane 1 is 7f."""
    pair = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)  # -2.0 is 0xc000: rotated 0x8001
    data = pair.view(torch.int16).numpy().tobytes() + b"\xab"
    stored = bytes(codecs.encode("float2-zstd", memoryview(data)))
    assert stored == (2).to_bytes(8, "little") * 2 + bytes([0x00, 0x01]) + bytes([0x7f, 0x80]) + b"\xab"
    # A compressible exponent plane is one zstd frame, shorter than the plane.
    ones = torch.full((100_000,), 1.5, dtype=torch.float32).numpy().tobytes()
    stored = bytes(codecs.encode("float4-zstd", memoryview(ones)))
    lengths = np.frombuffer(stored[:32], dtype="<u8")
    assert all(n < 100_000 for n in lengths)  # constant planes: all compressed
    offset = 32 + int(lengths[:3].sum())
    frame = stored[offset : offset + int(lengths[3])]
    assert zstandard.ZstdDecompressor().decompress(frame) == bytes([0x7f]) * 100_000


def test_random_mantissa_planes_are_stored_raw():
    data = torch.randn(100_000, generator=torch.Generator().manual_seed(2)).numpy().tobytes()
    stored = bytes(codecs.encode("float4-zstd", memoryview(data)))
    lengths = np.frombuffer(stored[:32], dtype="<u8")
    assert list(lengths[:3]) == [100_000] * 3 and lengths[3] < 50_000


def test_an_exponent_plane_is_stored_within_a_few_percent_of_its_entropy():
    """Normal weights' exponent plane goes through zstd's Huffman coding of literals alone: 1.024x its
    order-0 entropy here. A 16 KiB-window match search (the codec before) stores it 1.053x, level 1
    1.127x, and zstd skipping matches without literal compression forced on about 3x."""
    n = 400_000
    values = torch.randn(n, generator=torch.Generator().manual_seed(5)).mul(0.02).to(torch.bfloat16)
    data = values.view(torch.int16).numpy().tobytes()
    stored = bytes(codecs.encode("float2-zstd", memoryview(data)))
    exponents = (np.frombuffer(data, dtype="<u2") >> 7).astype(np.uint8)  # the rotated element's high byte
    shares = np.bincount(exponents, minlength=256) / n
    entropy_bits = -(shares[shares > 0] * np.log2(shares[shares > 0])).sum() * n
    lengths = np.frombuffer(stored[:16], dtype="<u8")
    assert lengths[1] < 1.04 * entropy_bits / 8
    assert bytes(codecs.decode("float2-zstd", stored, len(data), "x")) == data


def test_without_the_standard_zstd_module_planes_take_level_1_and_still_round_trip(monkeypatch):
    """A Python 3.14 built without ``compression.zstd`` (or no backports.zstd): saves keep working."""
    data = torch.randn(200_000, generator=torch.Generator().manual_seed(6)).mul(0.02).bfloat16()
    data = data.view(torch.int16).numpy().tobytes()
    huffman = bytes(codecs.encode("float2-zstd", memoryview(data)))
    monkeypatch.setattr(codecs, "_standard_zstd", lambda: None)
    level_1 = bytes(codecs.encode("float2-zstd", memoryview(data)))
    assert bytes(codecs.decode("float2-zstd", level_1, len(data), "x")) == data
    assert len(huffman) < len(level_1) < len(data) * 0.7


def test_the_stored_bytes_hold_no_memory_past_their_end():
    """The encoder writes into room for every plane raw, then gives back what compression saved."""
    data = torch.randn(300_001).bfloat16().view(torch.int16).numpy().tobytes()
    stored = codecs.encode("float2-zstd", memoryview(data))
    assert len(stored) < 0.8 * len(data)
    assert stored.obj.nbytes == len(stored)


def test_neither_direction_writes_into_its_input_or_aliases_it():
    tensor = torch.randn(50_000).bfloat16()
    before = tensor.clone()
    source = tensor.view(torch.uint8).numpy()
    stored = codecs.encode("float2-zstd", memoryview(source))
    assert torch.equal(tensor.view(torch.int16), before.view(torch.int16))
    frozen = bytes(stored)
    digest = hashlib.sha256(frozen).digest()
    decoded = codecs.decode("float2-zstd", frozen, tensor.numel() * 2, "x")
    assert bytes(decoded) == source.tobytes()
    writable = np.frombuffer(decoded, dtype=np.uint8)
    if writable.flags.writeable:  # a private buffer: changing it changes nothing else
        writable[:] = 0
    assert hashlib.sha256(frozen).digest() == digest
    assert torch.equal(tensor.view(torch.int16), before.view(torch.int16))
    # The base of a delta is not written either.
    base = bytearray(source.tobytes()[::-1])
    kept = bytes(base)
    codecs.decode("floatdelta2-zstd", bytes(codecs.encode("floatdelta2-zstd", memoryview(source), base)),
                  len(base), "x", base)
    assert base == kept


def _stored(codec: str = "float2-zstd", n: int = 20_000) -> tuple[bytes, bytes]:
    values = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    data = values.view(torch.int16).numpy().tobytes() + b"\x01"
    return data, bytes(codecs.encode(codec, memoryview(data)))


@pytest.mark.parametrize("damage", ["truncated", "extended", "header", "short header", "frame byte",
                                    "raw claims", "no content size"])
def test_damaged_stored_bytes_raise_corrupt_data_naming_the_chunk(damage):
    data, stored = _stored()
    lengths = [int(n) for n in np.frombuffer(stored[:16], dtype="<u8")]
    assert lengths[0] == 20_000 and lengths[1] < 20_000  # mantissa raw, exponent compressed
    if damage == "truncated":
        bad = stored[:-2]
    elif damage == "extended":
        bad = stored + b"\x00"
    elif damage == "header":
        bad = (lengths[0] - 1).to_bytes(8, "little") + (lengths[1] + 1).to_bytes(8, "little") + stored[16:]
    elif damage == "short header":
        bad = stored[:9]
    elif damage == "frame byte":  # inside the exponent plane's frame: its checksum-less blocks fail to decode
        frame_at = 16 + lengths[0]
        bad = stored[:frame_at] + b"\x00\x00\x00\x00" + stored[frame_at + 4:]  # the frame's magic number
    elif damage == "raw claims":  # a header whose lengths add up but name the frame raw
        bad = (2**64 - 1).to_bytes(8, "little") + stored[8:]
    else:
        frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(20_000))
        bad = stored[:8] + len(frame).to_bytes(8, "little") + stored[16:16 + lengths[0]] + frame + stored[-1:]
    with pytest.raises(CorruptDataError, match="^chunk ab12"):
        codecs.decode("float2-zstd", bad, len(data), "chunk ab12")


def test_a_plane_frame_holding_more_than_it_declares_is_refused_without_allocating_it():
    """A decompression bomb in the exponent plane: 64 MiB of zeros in a frame whose header says 64 KiB."""
    count = 2**16
    compressor = zstandard.ZstdCompressor(level=1).compressobj(size=2**26)
    frame = b"".join(compressor.compress(bytes(2**20)) for _ in range(64)) + compressor.flush()
    forged = frame[:6] + count.to_bytes(4, "little") + frame[10:]
    assert zstandard.frame_content_size(forged) == count
    plane0 = bytes(count)
    stored = count.to_bytes(8, "little") + len(forged).to_bytes(8, "little") + plane0 + forged
    tracemalloc.start()
    started = time.process_time()
    try:
        with pytest.raises(CorruptDataError, match="bomb: plane 1 is not one complete zstd frame"):
            codecs.decode("float2-zstd", stored, 2 * count, "bomb")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.process_time() - started < 0.5
    assert peak < 4 * 2 * count + 2**20, peak  # the output and a plane, never the 64 MiB
    # A header whose frame declares more than the plane holds is refused before decompressing.
    honest = zstandard.ZstdCompressor().compress(bytes(2 * count))
    stored = count.to_bytes(8, "little") + len(honest).to_bytes(8, "little") + plane0 + honest
    with pytest.raises(CorruptDataError, match="declares 131072 bytes"):
        codecs.decode("float2-zstd", stored, 2 * count, "bomb")


def _codecs_of(repo, name: str) -> dict[str, set[str]]:
    reader = SpecReader(repo, name)
    out: dict[str, set[str]] = {}
    for entry in reader.tensors:
        shards = entry["shards"] if isinstance(entry["shards"], list) else []
        out[entry["key"]] = {reader.chunks[p[0]]["codec"] for shard in shards for p in shard["pieces"]}
    return out


def _state() -> dict:
    gen = torch.Generator().manual_seed(5)
    return {"bf16": torch.randn(300_000, generator=gen).bfloat16(), "fp16": torch.randn(200_000, generator=gen).half(),
            "fp32": torch.randn(100_000, generator=gen), "fp64": torch.randn(40_000, generator=gen).double(),
            "int": torch.arange(100_000), "small": torch.ones(10)}


def test_auto_weighs_the_float_codec_against_the_shuffle_on_a_sample():
    """Weights (signs at random): the float codec; a first moment whose signs come in long runs: the
    shuffle, which keeps the sign in the exponent's byte where zstd's matches find the runs."""
    gen = torch.Generator().manual_seed(4)
    weights = torch.randn(2**20, generator=gen).to(torch.bfloat16)
    runs = (torch.randn(2**20, generator=gen).abs() * torch.where(torch.arange(2**20) // 4096 % 2 == 0, 1, -1))
    runs = (runs * 1e-3).to(torch.bfloat16)
    as_bytes = [memoryview(t.view(torch.int16).numpy().tobytes()) for t in (weights, runs)]
    chosen = [codecs.smaller_on_sample(["float2-zstd", "shuffle2-zstd"], data) for data in as_bytes]
    sizes = [[len(codecs.encode(c, data)) for c in ("float2-zstd", "shuffle2-zstd")] for data in as_bytes]
    assert chosen == ["float2-zstd", "shuffle2-zstd"], sizes
    assert sizes[0][0] < sizes[0][1] and sizes[1][1] < sizes[1][0]  # the sample told the truth


@pytest.mark.parametrize("compression", ["float-zstd", "auto"])
def test_a_save_stores_floating_point_tensors_with_the_float_codecs(tmp_path, compression):
    repo = tmp_path / "repo"
    state = _state()
    ckptfmt.save(state, f"{repo}/a", compression=compression, chunk_size=2**18)
    loaded = ckptfmt.load(f"{repo}/a")
    assert all(torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())
    assert ckptfmt.verify(str(repo)).ok
    used = _codecs_of(repo, "a")
    assert used["bf16"] == used["fp16"] == {"float2-zstd"}
    assert used["fp32"] == {"float4-zstd"} and used["fp64"] == {"float8-zstd"}
    assert used["int"] == {"shuffle8-zstd"}
    assert used["small"] <= {"float4-zstd", "shuffle4-zstd", "none"}  # a pack of float32 alone: as float32 is stored
    # The second implementation, written from the spec alone, reads every tensor bit for bit.
    reader = SpecReader(repo, "a")
    assert all(reader.tensor_bytes(k)[1] == v.view(torch.uint8).numpy().tobytes() for k, v in state.items())


def _chunk_rows_of(repo, name: str) -> dict[str, set[int]]:
    reader = SpecReader(repo, name)
    return {entry["key"]: {p[0] for shard in entry["shards"] for p in shard["pieces"]} for entry in reader.tensors}


def _small_state() -> dict:
    """A small model's tensors, every one under 256 KiB, dtypes interleaved: 70 float32 of 64 KiB (more
    than a pack of 4 MiB holds), 18 bfloat16 and 5 float16 matrices, an int64 step, a bool mask."""
    gen = torch.Generator().manual_seed(7)
    state: dict = {}
    for layer in range(70):
        state[f"fp32.{layer}"] = torch.randn(128, 128, generator=gen) * 0.02
        if layer % 4 == 0:
            state[f"bf16.{layer}"] = (torch.randn(128, 64, generator=gen) * 0.02).bfloat16()
        if layer % 16 == 0:
            state[f"fp16.{layer}"] = (torch.randn(64, 64, generator=gen) * 0.02).half()
    state["step"], state["mask"] = torch.tensor(1000), torch.ones(77, dtype=torch.bool)
    return state


@pytest.mark.parametrize("compression", ["float-zstd", "auto"])
def test_small_tensors_are_packed_by_float_dtype_and_take_its_float_codec(tmp_path, compression):
    """Spec 5.2: a pack per floating dtype (and one for the rest), each filled in order and closed when
    full; the float packs stored with their dtype's float codec, which stores them smaller than the one
    mixed pack of zstd that shuffle-zstd still writes."""
    repo, state = tmp_path / "repo", _small_state()
    ckptfmt.save(state, f"{repo}/a", compression=compression)
    ckptfmt.save(state, f"{repo}/b", compression="shuffle-zstd")
    reader, rows, used = SpecReader(repo, "a"), _chunk_rows_of(repo, "a"), _codecs_of(repo, "a")
    by_dtype: dict[str, set[int]] = {}
    for key, chunk_rows in rows.items():
        by_dtype.setdefault(key.split(".")[0] if "." in key else "other", set()).update(chunk_rows)
    assert all(not (by_dtype[a] & by_dtype[b]) for a in by_dtype for b in by_dtype if a < b), by_dtype
    assert len(by_dtype["fp32"]) == 2 and len(by_dtype["bf16"]) == len(by_dtype["fp16"]) == len(by_dtype["other"]) == 1
    assert set().union(*(used[k] for k in state if k.startswith("fp32"))) == {"float4-zstd"}
    assert set().union(*(used[k] for k in state if k.startswith("bf16"))) == {"float2-zstd"}
    assert set().union(*(used[k] for k in state if k.startswith("fp16"))) == {"float2-zstd"}
    assert used["step"] == used["mask"] and used["step"] <= {"zstd", "none"}
    # each float pack holds its tensors in their order, 64-byte aligned, the first full before the next
    fp32_places = [(p[0], p[1]) for k in state if k.startswith("fp32")
                   for p in next(e for e in reader.tensors if e["key"] == k)["shards"][0]["pieces"]]
    assert fp32_places == sorted(fp32_places) and all(offset % 64 == 0 for _, offset in fp32_places)
    assert all(reader.tensor_bytes(k)[1] == v.reshape(-1).view(torch.uint8).numpy().tobytes() for k, v in state.items())
    assert all(torch.equal(ckptfmt.load(f"{repo}/a")[k], v) for k, v in state.items())
    stored = {name: sum(c["stored_size"] for c in SpecReader(repo, name).chunks) for name in ("a", "b")}
    assert stored["a"] < 0.93 * stored["b"], stored  # the float codec on the packs: 8% or more smaller
    assert len({r for chunk_rows in _chunk_rows_of(repo, "b").values() for r in chunk_rows}) == 2  # one sequence


def test_auto_stores_a_moved_float_tensor_as_the_smaller_delta(tmp_path):
    repo = tmp_path / "repo"
    state = _state()
    ckptfmt.save(state, f"{repo}/a", compression="auto", chunk_size=2**18)
    gen = torch.Generator().manual_seed(9)
    for key in ("bf16", "fp32"):
        state[key] = state[key] + (torch.randn(state[key].shape, generator=gen) * 1e-6).to(state[key].dtype)
    ckptfmt.save(state, f"{repo}/b", compression="auto", chunk_size=2**18)
    used = _codecs_of(repo, "b")
    # Whichever delta stores a sample smaller: here the float delta for fp32; for bf16, where most
    # elements did not move at all (an update under half a unit in the last place), the XOR's zero runs
    # go to one frame.
    assert used["fp32"] == {"floatdelta4-zstd"}, used
    assert used["bf16"] <= {"floatdelta2-zstd", "delta2-zstd"}, used
    assert used["fp64"] == {"float8-zstd"}  # unchanged: the first save's chunks
    loaded = ckptfmt.load(f"{repo}/b")
    assert all(torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())
    assert ckptfmt.verify(str(repo)).ok
    reader = SpecReader(repo, "b")
    assert all(reader.tensor_bytes(k)[1] == v.view(torch.uint8).numpy().tobytes() for k, v in state.items())


def test_a_reader_of_1_10_refuses_the_float_codecs_by_name(tmp_path, monkeypatch):
    """1.10's readers know no float codec: loading fails on the first with "unknown chunk codec"."""
    ckptfmt.save({"w": torch.randn(100_000)}, f"{tmp_path}/repo/a", compression="float-zstd")
    older = codecs.CODECS - codecs.FLOAT_CODECS - codecs.FLOAT_DELTA_CODECS
    monkeypatch.setattr(codecs, "CODECS", older)
    from ckptfmt.format import chunk_table

    monkeypatch.setattr(chunk_table, "CODECS", older)
    with pytest.raises(ManifestError, match="unknown chunk codec 'float4-zstd'"):
        ckptfmt.load(f"{tmp_path}/repo/a")


def test_the_specs_worked_example_is_what_ckptfmt_stores():
    """FORMAT.md 5.3's example of the float planes, byte for byte."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "spec" / "FORMAT.md").read_text()
    given = re.search(r"`x` = `([0-9a-f ]+)`.*?`planes\(x, 2\)` = `([0-9a-f ]+)`", text, re.S)
    assert given, "5.3 gives no example of the float planes"
    x, stored = (bytes.fromhex(group) for group in given.groups())
    assert bytes(codecs.encode("float2-zstd", memoryview(x))) == stored
    assert bytes(codecs.decode("float2-zstd", stored, len(x), "example")) == x


@pytest.mark.parametrize("codec", ["float2-zstd", "float4-zstd", "float8-zstd"])
def test_whatever_the_stored_bytes_claim_decode_returns_size_bytes_or_raises(codec):
    """Stored bytes damaged at random (bytes flipped, cut, headers rewritten to other lengths): decode
    gives exactly ``size`` bytes or raises CorruptDataError, never anything else."""
    rng = np.random.default_rng(8)
    width = int(codec[len("float") : -len("-zstd")])
    data = _special_values({2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[width], 3001) + b"\x07"
    stored = bytearray(codecs.encode(codec, memoryview(data)))
    for trial in range(300):
        bad = bytearray(stored)
        kind = trial % 3
        if kind == 0:
            for at in rng.integers(0, len(bad), 1 + trial % 5):
                bad[at] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:
            bad = bad[: int(rng.integers(0, len(bad)))]
        else:
            j = int(rng.integers(0, width))
            bad[8 * j : 8 * j + 8] = int(rng.integers(0, 2 * 3001)).to_bytes(8, "little")
        try:
            out = codecs.decode(codec, bytes(bad), len(data), "fuzzed")
        except CorruptDataError as exc:
            assert str(exc).startswith("fuzzed"), exc
        else:
            assert len(out) == len(data)
