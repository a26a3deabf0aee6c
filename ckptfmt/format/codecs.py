"""Chunk codecs: how a chunk's bytes are encoded on storage.

A chunk is always named by the BLAKE3 hash of its *decoded* bytes, so the codec
changes where it is stored (the key's suffix) but never its identity.

Codecs: ``none`` (the default: on fp32 weights zstd gains ~1.08x and is slower
than the disk), ``zstd``, ``shuffleN-zstd`` (a byte-shuffle over N-byte
elements, then zstd; helps bf16/fp16), and ``deltaN-zstd`` (format 1.5): the
bytes XORed with those of a base chunk of the same size (the same tensor region
in the parent checkpoint), then shuffled over N-byte elements and zstd-compressed.
Weights that moved a little keep their sign, exponent and high mantissa bits, so
the XOR is mostly zero bytes in the planes the shuffle puts together.

``floatN-zstd`` (format 1.11) is the codec for floating-point elements of N = 2, 4 or 8 bytes
(bf16/fp16, fp32, fp64), and ``floatdeltaN-zstd`` its delta form (XOR with the base first). Each
element, read as a little-endian N-byte unsigned integer, is rotated left by one bit, so that the sign
bit drops to bit 0 and the exponent's top bits make the element's high byte (all 8 exponent bits for
bf16 and fp32, the top 8 of fp64's 11, fp16's 5 and its 3 top mantissa bits). The rotated bytes are
cut into N planes (plane j: byte j of every element) and each plane is stored on its own: as a zstd
frame where that is shorter, raw otherwise. Why this design, measured on a small transformer's
weights and AdamW moments (docs/performance.md, "Float codec"):

- The exponent plane carries nearly all the redundancy (about 2.5 bits of entropy a byte); the
  mantissa planes are almost random (7.95 bits). ZipNN and DFloat11 split the same way, and so
  store less than shuffle-zstd on weights and Adam's second moment (the sign, constant there, joins
  the mantissa plane instead of doubling the exponent byte's alphabet).
- zstd entropy-codes literals with Huffman, per 128 KiB block; on an exponent plane matches rarely
  pay (each costs more than the literals it replaces). ``_HuffmanCompressor`` reduces zstd to that
  Huffman coding: the fast strategy told to skip so far ahead that it takes almost no match, with
  the literals' coding forced on (zstd turns it off by default whenever it skips). On a small
  transformer's bf16 weights that stores the exponent plane 3.46x where a 16 KiB-window fast search
  stored it 3.15x, at 2.7x its speed; the frames are plain zstd frames, so any zstd decoder reads
  them. Adam's first moment keeps its signs in runs, where level 1's matches can win; so each plane
  goes to whichever of the two stores a 128 KiB sample of it (16 blocks spread over it) smaller.
- A mantissa plane is compressed only where that makes its sample 2% smaller (runs of zeros in a
  delta, a constant sign), so the random planes cost a copy, not a zstd pass.
- numpy, zstandard and the standard library's zstd (``compression.zstd``, Python 3.14; the
  ``backports.zstd`` package before it), for the one zstd parameter zstandard does not pass: literal
  compression. The rotation is two shifts and an or, run a block at a time in cache-sized scratch.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from ckptfmt.errors import CorruptDataError, ManifestError, quoted

NONE = "none"
ZSTD = "zstd"
_SHUFFLE_WIDTHS = (2, 4, 8)
_DELTA_WIDTHS = (1, 2, 4, 8)
_FLOAT_WIDTHS = (2, 4, 8)
FLOAT_CODECS = frozenset(f"float{w}-zstd" for w in _FLOAT_WIDTHS)
FLOAT_DELTA_CODECS = frozenset(f"floatdelta{w}-zstd" for w in _FLOAT_WIDTHS)
DELTA_CODECS = frozenset({*(f"delta{w}-zstd" for w in _DELTA_WIDTHS), *FLOAT_DELTA_CODECS})
CODECS = frozenset({NONE, ZSTD, *(f"shuffle{w}-zstd" for w in _SHUFFLE_WIDTHS), *DELTA_CODECS, *FLOAT_CODECS})
#: What ``compression`` may be set to; ``delta-zstd`` and ``auto`` choose a codec per chunk.
COMPRESSIONS = (None, NONE, ZSTD, "shuffle-zstd", "float-zstd", "delta-zstd", "auto")
#: The compressions that store a chunk against its parent's where that is smaller (spec 5.5).
DELTA_COMPRESSIONS = frozenset({"delta-zstd", "auto"})
#: The compressions that store floating-point elements with the float codecs (spec 5.3), a pack of one
#: float dtype included (spec 5.2).
FLOAT_COMPRESSIONS = frozenset({"float-zstd", "auto"})
ZSTD_LEVEL = 1
#: A mantissa plane is compressed only where that makes a sample of it this much smaller (2%).
_PAYS = 0.98
_SAMPLE_BLOCKS, _SAMPLE_BLOCK = 16, 8192


def check_codec(codec: object) -> str:
    """Return ``codec`` if this reader knows it, else raise ManifestError."""
    if codec not in CODECS:
        raise ManifestError(f"unknown chunk codec {quoted(codec)}")
    return codec


def is_delta(codec: str) -> bool:
    """Whether chunks of ``codec`` are stored against a base chunk."""
    return codec in DELTA_CODECS


def codec_for(compression: str | None, itemsize: int, floating: bool = False) -> str:
    """The codec a writer uses for ``compression`` where it stores a chunk whole (no base): 'delta-zstd'
    falls back to 'shuffle-zstd'; 'float-zstd' and 'auto' use ``float<itemsize>-zstd`` for the chunks of
    one ``floating`` tensor (a real floating-point dtype) of 2, 4 or 8 bytes, and 'shuffle-zstd''s codec
    for the others."""
    if compression in (None, NONE):
        return NONE
    if compression == ZSTD:
        return ZSTD
    if compression in FLOAT_COMPRESSIONS and floating and itemsize in _FLOAT_WIDTHS:
        return f"float{itemsize}-zstd"
    if compression in ("shuffle-zstd", "float-zstd", "delta-zstd", "auto"):
        return f"shuffle{itemsize}-zstd" if itemsize in _SHUFFLE_WIDTHS else ZSTD
    raise ValueError(f"unknown compression {compression!r}: use one of {', '.join(map(repr, COMPRESSIONS))}")


def delta_codec_for(itemsize: int, floating: bool = False) -> str:
    """The delta codec for elements of ``itemsize`` bytes: ``floatdelta<itemsize>-zstd`` for a
    ``floating`` tensor of 2, 4 or 8 bytes (``compression="auto"``), else ``delta<itemsize>-zstd``."""
    if floating and itemsize in _FLOAT_WIDTHS:
        return f"floatdelta{itemsize}-zstd"
    return f"delta{itemsize}-zstd" if itemsize in _DELTA_WIDTHS else "delta1-zstd"


def smaller_on_sample(candidates: list[str], data: memoryview, base: memoryview | bytes | None = None) -> str:
    """Which of ``candidates`` stores a sample of ``data`` smallest (the first of equals): 16 blocks of
    32 KiB spread over it, at offsets that are multiples of 8 (whole elements), or ``data`` itself
    where it is no longer; a delta codec encodes the sample against the same bytes of ``base``."""
    if len(candidates) == 1:
        return candidates[0]
    blocks, block = 16, 32 * 1024
    if len(data) <= blocks * block:
        sample, base_sample = data, base
    else:
        step = (len(data) // blocks) & ~7
        sample = memoryview(_spread(data, blocks, block, step))
        base_sample = None if base is None else _spread(base, blocks, block, step)
    sizes = [len(encode(c, sample, base_sample if is_delta(c) else None)) for c in candidates]
    return candidates[sizes.index(min(sizes))]


def is_float(codec: str) -> bool:
    """Whether ``codec`` stores bytes as planes of rotated floating-point elements (1.11)."""
    return codec in FLOAT_CODECS or codec in FLOAT_DELTA_CODECS


def _shuffle_width(codec: str) -> int:
    for prefix in ("shuffle", "floatdelta", "float", "delta"):
        if codec.startswith(prefix):
            return int(codec[len(prefix) : -len("-zstd")])
    return 1


def xor(data: memoryview | bytes, base: memoryview | bytes) -> bytes:
    """Byte-wise XOR of two equally long byte strings (8 bytes at a time where the length allows)."""
    import numpy as np

    a, b = np.frombuffer(data, dtype=np.uint8), np.frombuffer(base, dtype=np.uint8)
    if len(a) != len(b):
        raise ValueError(f"delta of {len(a)} bytes against a base of {len(b)}")
    if len(a) % 8 == 0:
        return np.bitwise_xor(a.view(np.uint64), b.view(np.uint64)).tobytes()
    return np.bitwise_xor(a, b).tobytes()


def _shuffle(data: memoryview, width: int) -> bytes:
    """Byte-shuffle: all first bytes of each element, then all second bytes, ... (tail kept)."""
    import numpy as np

    raw = np.frombuffer(data, dtype=np.uint8)
    whole = len(raw) - len(raw) % width
    body = raw[:whole].reshape(-1, width).T.tobytes()
    return body + raw[whole:].tobytes()


def _unshuffle(data: bytes, width: int) -> bytes:
    import numpy as np

    raw = np.frombuffer(data, dtype=np.uint8)
    whole = len(raw) - len(raw) % width
    body = raw[:whole].reshape(width, -1).T.tobytes()
    return body + raw[whole:].tobytes()


_UINT = {2: "<u2", 4: "<u4", 8: "<u8"}


#: zstd's experimental ``ZSTD_c_literalCompressionMode`` (zstd.h) and its ``ZSTD_ps_enable``.
_LITERAL_COMPRESSION_MODE, _ENABLE = 1002, 1


def _standard_zstd() -> Any:
    """The standard library's zstd module (``compression.zstd``, Python 3.14; ``backports.zstd`` before), or
    None where this Python has none (built without it, or the backport not installed)."""
    try:
        if sys.version_info >= (3, 14):
            from compression import zstd
        else:
            from backports import zstd
    except ImportError:
        return None
    return zstd


class _HuffmanCompressor:
    """zstd reduced to the Huffman coding of its literals (see the module's docstring): the fast
    strategy stepping 100,000 bytes past each failed match search, literal compression forced on."""

    def __init__(self, zstd: Any) -> None:
        param = zstd.CompressionParameter
        self._options = {
            param.strategy: zstd.Strategy.fast, param.window_log: 14, param.hash_log: 10, param.min_match: 7,
            param.target_length: 100_000, param.content_size_flag: 1, _LITERAL_COMPRESSION_MODE: _ENABLE}
        self._compress = zstd.compress

    def compress(self, data: bytes) -> bytes:
        return self._compress(data, options=self._options)


def _plane_compressors() -> list[Any]:
    """What makes a compressor for a plane's sample to be tried with: Huffman alone and level 1; level 1
    alone where this Python has no standard zstd module (valid frames still; exponent planes ~10%
    larger)."""
    zstd = _standard_zstd()
    return [_plane_compressor] if zstd is None else [functools.partial(_HuffmanCompressor, zstd), _plane_compressor]


def _spread(data: memoryview | bytes, blocks: int, block: int, step: int) -> bytes:
    """``blocks`` runs of ``block`` bytes of ``data``, ``step`` bytes apart from its start."""
    view = memoryview(data)
    return b"".join(view[i * step : i * step + block] for i in range(blocks))


def _sample(plane: bytes) -> bytes:
    """16 blocks of 8 KiB spread over ``plane`` (the plane itself when it is no longer)."""
    if len(plane) <= _SAMPLE_BLOCKS * _SAMPLE_BLOCK:
        return plane
    return _spread(plane, _SAMPLE_BLOCKS, _SAMPLE_BLOCK, len(plane) // _SAMPLE_BLOCKS)


def _compress_plane(plane: Any, exponent: bool) -> bytes | None:
    """The zstd frame of ``plane`` by whichever compressor stores a sample of it smaller, or None (store it
    raw) where neither makes the sample ``_PAYS`` smaller (any gain at all for the exponent plane)."""
    sample = _sample(plane)
    best, best_frame, best_size = None, b"", len(sample) * (1.0 if exponent else _PAYS)
    for make in _plane_compressors():
        frame = make().compress(sample)
        if len(frame) < best_size:
            best, best_frame, best_size = make, frame, len(frame)
    if best is None:
        return None
    frame = best_frame if len(sample) == len(plane) else best().compress(plane)  # a whole plane: done once
    return frame if len(frame) < len(plane) else None


def _float_encode(data: memoryview | bytes, width: int) -> memoryview:
    """``floatN-zstd``'s stored bytes (spec 5.3): N little-endian uint64 plane lengths, the N planes of the
    rotated elements (each a zstd frame where that is shorter, else raw), then the tail bytes unchanged.
    The planes are written raw into their places in the output and compressed from there."""
    import numpy as np

    raw = np.frombuffer(data, dtype=np.uint8)
    whole = len(raw) - len(raw) % width
    count = whole // width
    out = np.empty(8 * width + len(raw), dtype=np.uint8)  # every plane raw: the most it can take
    planes = out[8 * width : 8 * width + whole].reshape(width, count)
    _kernels().split_planes(raw[:whole].view(_UINT[width]), planes)
    lengths = []
    offset = 8 * width
    for j in range(width):
        frame = _compress_plane(planes[j], exponent=j == width - 1) if count else None
        assert frame is None or len(frame) < count, "a longer frame would overwrite the next plane unread"
        piece = planes[j] if frame is None else np.frombuffer(frame, dtype=np.uint8)
        if frame is not None or offset != 8 * width + j * count:  # a raw plane in its place stays there
            out[offset : offset + len(piece)] = piece
        lengths.append(len(piece))
        offset += len(piece)
    out[: 8 * width] = np.array(lengths, dtype="<u8").view(np.uint8)
    size = offset + len(raw) - whole
    out[offset:size] = raw[whole:]
    del planes, piece  # no view of ``out`` may outlive its resizing
    out.resize(size, refcheck=False)  # in place (realloc): what compression saved is freed, nothing copied
    return out.data


def _kernels() -> Any:
    """ckptfmt.kernels (C or numpy), imported on first use: numpy stays out of the CLI's start."""
    from ckptfmt import kernels

    return kernels


def _plane_compressor() -> Any:
    """zstd level 1: for planes with runs and repeats (zeros of a delta, momenta's signs in runs)."""
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)


def _float_decode(stored: bytes | memoryview, size: int, width: int, where: str, codec: str) -> memoryview:
    """Inverse of ``_float_encode``, into a new buffer of exactly ``size`` bytes; every length the stored
    bytes claim is checked against ``size`` before anything is allocated or decompressed."""
    import numpy as np

    count, tail = divmod(size, width)
    stored = memoryview(stored).cast("B")
    if len(stored) < 8 * width:
        raise CorruptDataError(f"{where}: {codec} chunk of {len(stored)} bytes is shorter than its header")
    lengths = [int(n) for n in np.frombuffer(stored[: 8 * width], dtype="<u8")]
    if any(n > count for n in lengths) or 8 * width + sum(lengths) + tail != len(stored):
        raise CorruptDataError(f"{where}: {codec} plane lengths {lengths} do not fit {len(stored)} stored bytes "
                               f"of a chunk of {size}")
    planes = []
    offset = 8 * width
    for j, length in enumerate(lengths):
        piece = stored[offset : offset + length]
        offset += length
        planes.append(np.frombuffer(piece if length == count else _decompress_plane(piece, count, j, where),
                                    dtype=np.uint8))
    out = np.empty(size, dtype=np.uint8)  # a new buffer: nothing of ``stored`` is aliased
    values = out[: count * width].view(_UINT[width])
    _kernels().join_planes(planes, values)
    out[count * width :] = np.frombuffer(stored[offset:], dtype=np.uint8)
    return out.data


def _decompress_plane(frame: memoryview, count: int, j: int, where: str) -> bytes:
    """Plane ``j`` of ``count`` bytes from its zstd ``frame``, which must declare exactly that size."""
    import zstandard

    try:
        declared = zstandard.frame_content_size(frame)
        if declared != count:
            raise CorruptDataError(f"{where}: plane {j}'s zstd frame declares {declared} bytes, "
                                   f"the chunk's planes hold {count}")
        plane = zstandard.ZstdDecompressor().decompress(frame, max_output_size=count, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptDataError(f"{where}: plane {j} is not one complete zstd frame ({exc})") from None
    if len(plane) != count:
        raise CorruptDataError(f"{where}: plane {j} decompressed to {len(plane)} bytes, not {count}")
    return plane


def encode(codec: str, data: memoryview, base: memoryview | bytes | None = None) -> memoryview | bytes:
    """Encode decoded chunk bytes for storage (``none`` returns ``data`` itself, no copy); a delta codec
    needs the decoded bytes of its ``base``."""
    if codec == NONE:
        return data
    if is_delta(codec):
        if base is None:
            raise ValueError(f"codec {codec} needs a base chunk")
        data = memoryview(xor(data, base))
    width = _shuffle_width(codec)
    if is_float(codec):
        return _float_encode(data, width)
    import zstandard

    payload = _shuffle(data, width) if width > 1 else data
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(payload)


def decode(codec: str, stored: bytes, size: int, where: str,
           base: memoryview | bytes | None = None) -> bytes | memoryview:
    """Decode stored bytes into exactly ``size`` bytes; raises CorruptDataError naming ``where``. A delta
    codec needs the decoded (and verified) bytes of its ``base``."""
    if is_delta(codec) and (base is None or len(base) != size):
        raise CorruptDataError(f"{where}: a {codec} chunk of {size} bytes needs a base chunk of as many")
    if codec == NONE:
        if len(stored) != size:
            raise CorruptDataError(f"{where}: {len(stored)} bytes stored, manifest says {size}")
        return stored
    if is_float(codec):
        decoded = _float_decode(stored, size, _shuffle_width(codec), where, codec)
        return xor(decoded, base) if base is not None and is_delta(codec) else decoded
    import zstandard

    try:
        declared = zstandard.frame_content_size(stored)
        if declared != size:
            raise CorruptDataError(f"{where}: zstd frame declares {declared} bytes, manifest says {size}")
        # One shot into a buffer of the declared size: a frame that holds more (a decompression
        # bomb with a lying header) fails at once instead of growing the output without bound.
        data = zstandard.ZstdDecompressor().decompress(stored, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptDataError(f"{where}: stored bytes are not one complete zstd frame ({exc})") from None
    if len(data) != size:
        raise CorruptDataError(f"{where}: decompressed to {len(data)} bytes, manifest says {size}")
    width = _shuffle_width(codec)
    data = _unshuffle(data, width) if width > 1 else data
    return xor(data, base) if base is not None and is_delta(codec) else data
