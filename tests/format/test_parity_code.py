"""The parity code (spec 5.6) on its own: the bytes are the ones the spec defines (checked with another
library's GF(2^8) arithmetic, as a second reader would), any M lost pieces of a stripe rebuild bit for bit,
striping tiles every object, and a parity record is refused, by rule and quickly, for every way it can lie."""

from __future__ import annotations

import random
import time

import msgpack
import pytest
import reedsolo

from ckptfmt import ManifestError, UnsupportedVersionError
from ckptfmt.format import erasure
from ckptfmt.format.parity_record import (
    ParityRecord,
    Piece,
    Stripe,
    copy_key,
    parity_digest,
    parity_key,
    record_digest,
    record_key,
)
from ckptfmt.repository.protection import parse_parity, plan_stripes

H = "ab" * 32


def _spec_parity(pieces: list[bytes], k: int, m: int, length: int) -> list[bytes]:
    """Parity as spec 5.6 defines it, computed with reedsolo's GF(2^8) tables (polynomial 0x11d): V has the
    row (1, 0, ..., 0) and rows (x^0, ..., x^(K-1)) for x = 2^(r-1); G = V * inverse(top K rows of V)."""
    reedsolo.init_tables(prim=0x11D)
    mul, inv = reedsolo.gf_mul, reedsolo.gf_inverse

    def row(r: int) -> list[int]:
        if r == 0:
            return [1] + [0] * (k - 1)
        x = reedsolo.gf_pow(2, r - 1)
        return [reedsolo.gf_pow(x, c) for c in range(k)]

    top = [row(r) + [int(r == c) for c in range(k)] for r in range(k)]  # [V_k | I], Gauss-Jordan to [I | V_k^-1]
    for col in range(k):
        pivot = next(r for r in range(col, k) if top[r][col])
        top[col], top[pivot] = top[pivot], top[col]
        scale = inv(top[col][col])
        top[col] = [mul(v, scale) for v in top[col]]
        for r in range(k):
            if r != col and top[r][col]:
                factor = top[r][col]
                top[r] = [a ^ mul(factor, b) for a, b in zip(top[r], top[col])]
    inverse = [line[k:] for line in top]
    padded = [p + bytes(length - len(p)) for p in pieces] + [bytes(length)] * (k - len(pieces))
    out = []
    for i in range(m):
        v = row(k + i)
        g = [0] * k
        for j in range(k):
            for t in range(k):
                g[j] ^= mul(v[t], inverse[t][j])
        parity = bytearray(length)
        for j in range(k):
            if g[j]:
                for b in range(length):
                    parity[b] ^= mul(g[j], padded[j][b])
        out.append(bytes(parity))
    return out


@pytest.mark.parametrize(("k", "m"), [(1, 1), (3, 2), (4, 2), (8, 2), (5, 4)])
def test_the_parity_bytes_are_the_ones_the_spec_defines(k, m):
    rng = random.Random(k * 10 + m)
    length = 97
    pieces = [rng.randbytes(rng.randint(1, length)) for _ in range(max(1, k - 1))]  # short pieces, one place empty
    assert erasure.encode(pieces, k, m, length) == _spec_parity(pieces, k, m, length)


@pytest.mark.parametrize(("k", "m"), [(2, 1), (4, 2), (8, 2), (10, 4), (16, 3)])
def test_any_m_lost_pieces_rebuild_bit_for_bit_and_m_plus_one_do_not(k, m, monkeypatch):
    monkeypatch.setattr(erasure, "SEGMENT", 1000)  # several segments per piece, and a short last one
    rng = random.Random(k + m)
    length = 2500
    count = k - 1 if k > 2 else k  # one all-zero place when K > 2
    pieces = [rng.randbytes(rng.choice([length, length - 7, 13])) for _ in range(count)]
    parity = erasure.encode(pieces, k, m, length)
    whole = {i: p + bytes(length - len(p)) for i, p in enumerate(pieces)} | {k + j: p for j, p in enumerate(parity)}
    for _ in range(5):
        lost = rng.sample(sorted(whole), m)
        available = {i: (pieces[i] if i < count else whole[i]) for i in whole if i not in lost}
        rebuilt = erasure.rebuild(available, k, m, length, count, lost)
        assert {i: rebuilt[i] for i in lost} == {i: whole[i] for i in lost}
    lost = rng.sample(sorted(whole), m + 1)
    if sum(i < count or i >= k for i in lost) > m:  # the zero places are known without reading
        with pytest.raises(ValueError, match="are needed"):
            erasure.rebuild({i: whole[i] for i in whole if i not in lost}, k, m, length, count, lost)


def test_parameters_are_checked():
    for k, m in [(0, 1), (1, 0), (200, 57), (True, 1)]:
        with pytest.raises(ValueError, match="K and M"):
            erasure.check_parameters(k, m)
    assert parse_parity("8+2") == (8, 2)
    for text in ["8", "8+", "+2", "8-2", "a+b", "0+2", "255+2"]:
        with pytest.raises(ValueError):
            parse_parity(text)


@pytest.mark.parametrize("seed", range(4))
def test_stripes_tile_every_object_with_at_most_k_pieces_of_distinct_objects(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 4096, 10_000, 50_000, 200_001]) for _ in range(rng.randint(1, 40))]
    k = rng.randint(1, 9)
    stripes = plan_stripes(sizes, k, piece_limit=65_536)
    covered: dict[int, list[tuple[int, int]]] = {}
    for stripe in stripes:
        assert 1 <= len(stripe) <= k
        assert len({p.obj for p in stripe}) == len(stripe)  # one lost object: one piece a stripe
        for p in stripe:
            assert 0 < p.length <= 65_536
            covered.setdefault(p.obj, []).append((p.offset, p.length))
    for obj, size in enumerate(sizes):
        end = 0
        for offset, length in sorted(covered.get(obj, [])):
            assert offset == end
            end += length
        assert end == size
    # Encoded as a record, the plan is accepted as it is.
    objects = tuple((f"a/manifest-{H}.msgpack" if i == 0 else f"chunks/{i:02x}/{i:02x}" + "0" * 62, s)
                    for i, s in enumerate(sizes))
    record = ParityRecord("a", H, k, 2, objects, tuple(
        Stripe(max(p.length for p in s), tuple(s), (H, H)) for s in stripes))
    assert ParityRecord.from_bytes(record.to_bytes(), "r") == record


def test_stripes_pad_little_when_big_objects_are_cut_into_many_pieces():
    """A transformer's chunks (scaled down: pieces of 16 units): two embedding chunks cut into 4 pieces,
    48 of one piece, 96 short ones. The parity a stripe row costs stays within 1% of the data over K."""
    sizes = [16] * 48 + [4] * 96 + [64, 61]  # the embedding last, as in a state dict
    for k in (4, 8):
        stripes = plan_stripes(sizes, k, piece_limit=16)
        row = sum(max(p.length for p in stripe) for stripe in stripes)
        assert row <= 1.01 * sum(sizes) / k, (k, row, sum(sizes) / k)


def _record_doc() -> dict:
    objects = [f"a/manifest-{H}.msgpack", "chunks/12/12" + "3" * 62, "chunks/45/45" + "6" * 62 + ".zstd"]
    return {"format": "ckptfmt-parity", "version": [2, 1], "requires": ["parity"], "name": "a", "manifest": H,
            "code": "rs-vandermonde-gf256", "k": 2, "m": 1, "objects": objects, "sizes": [10, 100, 60],
            "stripes": [[100, [[1, 0, 100], [0, 0, 10]], [H]], [60, [[2, 0, 60]], [H]]]}


def test_a_well_formed_record_reads():
    record = ParityRecord.from_bytes(msgpack.packb(_record_doc()), "r")
    assert record.k == 2 and record.m == 1 and record.stripes[0].pieces[0] == Piece(1, 0, 100)
    assert record.parity_bytes == 160
    assert ParityRecord.from_bytes(record.to_bytes(), "r") == record


HOSTILE = {
    "unknown code": {"code": "rs-cauchy"},
    "k zero": {"k": 0},
    "k+m over 256": {"k": 250, "m": 7},
    "k a float": {"k": 2.0},
    "name escapes": {"name": "../x"},
    "manifest hash short": {"manifest": "ab"},
    "object outside the repository": {"objects": ["../../etc/passwd", "chunks/12/12" + "3" * 62,
                                                  "chunks/45/45" + "6" * 62 + ".zstd"]},
    "another checkpoint's manifest": {"objects": [f"b/manifest-{H}.msgpack", "chunks/12/12" + "3" * 62,
                                                  "chunks/45/45" + "6" * 62 + ".zstd"]},
    "chunk key of the wrong folder": {"objects": [f"a/manifest-{H}.msgpack", "chunks/00/12" + "3" * 62,
                                                  "chunks/45/45" + "6" * 62 + ".zstd"]},
    "manifest not protected": {"objects": ["chunks/11/11" + "3" * 62, "chunks/12/12" + "3" * 62,
                                           "chunks/45/45" + "6" * 62 + ".zstd"]},
    "unknown codec": {"objects": [f"a/manifest-{H}.msgpack", "chunks/12/12" + "3" * 62 + ".lz4",
                                  "chunks/45/45" + "6" * 62 + ".zstd"]},
    "codec none spelled": {"objects": [f"a/manifest-{H}.msgpack", "chunks/12/12" + "3" * 62 + ".none",
                                       "chunks/45/45" + "6" * 62 + ".zstd"]},
    "base on a whole chunk": {"objects": [f"a/manifest-{H}.msgpack", "chunks/12/12" + "3" * 62 + ".zstd." + H,
                                          "chunks/45/45" + "6" * 62 + ".zstd"]},
    "delta without base": {"objects": [f"a/manifest-{H}.msgpack", "chunks/12/12" + "3" * 62 + ".delta4-zstd",
                                       "chunks/45/45" + "6" * 62 + ".zstd"]},
    "object twice": {"objects": [f"a/manifest-{H}.msgpack", "chunks/12/12" + "3" * 62, "chunks/12/12" + "3" * 62]},
    "sizes short": {"sizes": [10, 100]},
    "size negative": {"sizes": [10, -1, 60]},
    "size over the limit": {"sizes": [10, 2**40, 60]},
    "no stripes": {"stripes": []},
    "stripe not a triple": {"stripes": [[100, [[1, 0, 100]]]]},
    "stripe length zero": {"stripes": [[0, [[1, 0, 100], [0, 0, 10]], [H]], [60, [[2, 0, 60]], [H]]]},
    "stripe length huge": {"stripes": [[2**40, [[1, 0, 100], [0, 0, 10]], [H]], [60, [[2, 0, 60]], [H]]]},
    "more than k pieces": {"stripes": [[100, [[1, 0, 100], [0, 0, 10], [2, 0, 60]], [H]]]},
    "no pieces": {"stripes": [[100, [], [H]], [100, [[1, 0, 100], [0, 0, 10]], [H]], [60, [[2, 0, 60]], [H]]]},
    "parity count wrong": {"stripes": [[100, [[1, 0, 100], [0, 0, 10]], [H, H]], [60, [[2, 0, 60]], [H]]]},
    "parity name bad": {"stripes": [[100, [[1, 0, 100], [0, 0, 10]], ["x"]], [60, [[2, 0, 60]], [H]]]},
    "piece past the object": {"stripes": [[100, [[1, 50, 100], [0, 0, 10]], [H]], [60, [[2, 0, 60]], [H]]]},
    "piece longer than the stripe": {"stripes": [[50, [[1, 0, 100], [0, 0, 10]], [H]], [60, [[2, 0, 60]], [H]]]},
    "piece of no object": {"stripes": [[100, [[7, 0, 100], [0, 0, 10]], [H]], [60, [[2, 0, 60]], [H]]]},
    "gap in an object": {"stripes": [[100, [[1, 0, 90], [0, 0, 10]], [H]], [60, [[2, 0, 60]], [H]]]},
    "overlap in an object": {"stripes": [[100, [[1, 0, 100], [0, 0, 10]], [H]],
                                         [60, [[2, 0, 60], [1, 40, 60]], [H]]]},
    "object not covered": {"stripes": [[100, [[1, 0, 100], [0, 0, 10]], [H]]]},
    "piece not ints": {"stripes": [[100, [[1, 0, "100"], [0, 0, 10]], [H]], [60, [[2, 0, 60]], [H]]]},
    "feature undeclared": {"requires": []},
    "version before 2.1": {"version": [2, 0]},
    "missing member": {"sizes": None},
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_record_is_refused_by_rule(case):
    doc = _record_doc() | HOSTILE[case]
    doc = {k: v for k, v in doc.items() if v is not None}
    with pytest.raises(ManifestError):
        ParityRecord.from_bytes(msgpack.packb(doc), "r")


def test_a_record_of_a_newer_writer_is_upgrade_not_damage():
    for change in ({"requires": ["parity", "reed-solomon-v2"]}, {"version": [3, 0]}):
        with pytest.raises(UnsupportedVersionError, match="upgrade"):
            ParityRecord.from_bytes(msgpack.packb(_record_doc() | change), "r")


def test_a_huge_record_is_refused_in_bounded_time_and_memory():
    too_big = b"\x00" * (256 * 2**20 + 1)
    with pytest.raises(ManifestError, match="over the"):
        ParityRecord.from_bytes(too_big, "r")
    # A million stripes of one piece each (about 90 MB): refused for what they claim, within seconds.
    doc = _record_doc() | {"stripes": [[100, [[1, 0, 100]], [H]]] * 1_000_000}
    data = msgpack.packb(doc)
    started = time.perf_counter()
    with pytest.raises(ManifestError):
        ParityRecord.from_bytes(data, "r")
    assert time.perf_counter() - started < 30


def test_record_keys_and_names():
    assert record_key("a", H) == f"a/parity-{H}.msgpack"
    assert copy_key("a", H, 2) == f"_parity/records/a/parity-{H}.2.msgpack"
    assert parity_key(H, 1) == f"_parity/ab/{H}.1" and parity_digest(parity_key(H, 1)) == H
    assert record_digest(f"parity-{H}.msgpack") == H
    assert record_digest(f"parity-{H}.3.msgpack") == H
    assert record_digest("parity-xyz.msgpack") is None and record_digest("manifest-x.msgpack") is None
