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

The codec table needs nothing; the transforms import numpy and zstandard when
they run, so that listing a repository (which parses no chunk) loads neither.
"""

from __future__ import annotations

from ckptfmt.errors import CorruptDataError, ManifestError, quoted

NONE = "none"
ZSTD = "zstd"
_SHUFFLE_WIDTHS = (2, 4, 8)
_DELTA_WIDTHS = (1, 2, 4, 8)
DELTA_CODECS = frozenset(f"delta{w}-zstd" for w in _DELTA_WIDTHS)
CODECS = frozenset({NONE, ZSTD, *(f"shuffle{w}-zstd" for w in _SHUFFLE_WIDTHS), *DELTA_CODECS})
#: What ``compression`` may be set to; ``delta-zstd`` and ``auto`` choose a codec per chunk.
COMPRESSIONS = (None, NONE, ZSTD, "shuffle-zstd", "delta-zstd", "auto")
ZSTD_LEVEL = 1


def check_codec(codec: object) -> str:
    """Return ``codec`` if this reader knows it, else raise ManifestError."""
    if codec not in CODECS:
        raise ManifestError(f"unknown chunk codec {quoted(codec)}")
    return codec


def is_delta(codec: str) -> bool:
    """Whether chunks of ``codec`` are stored against a base chunk."""
    return codec in DELTA_CODECS


def codec_for(compression: str | None, itemsize: int) -> str:
    """The codec a writer uses for ``compression`` where it stores a chunk whole (no base): 'delta-zstd'
    falls back to 'shuffle-zstd', 'auto' starts from it."""
    if compression in (None, NONE):
        return NONE
    if compression == ZSTD:
        return ZSTD
    if compression in ("shuffle-zstd", "delta-zstd", "auto"):
        return f"shuffle{itemsize}-zstd" if itemsize in _SHUFFLE_WIDTHS else ZSTD
    raise ValueError(f"unknown compression {compression!r}: use one of {', '.join(map(repr, COMPRESSIONS))}")


def delta_codec_for(itemsize: int) -> str:
    """The delta codec for elements of ``itemsize`` bytes."""
    return f"delta{itemsize}-zstd" if itemsize in _DELTA_WIDTHS else "delta1-zstd"


def _shuffle_width(codec: str) -> int:
    if codec.startswith("shuffle"):
        return int(codec[len("shuffle") : -len("-zstd")])
    if codec.startswith("delta"):
        return int(codec[len("delta") : -len("-zstd")])
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


def encode(codec: str, data: memoryview, base: memoryview | bytes | None = None) -> memoryview | bytes:
    """Encode decoded chunk bytes for storage (``none`` returns ``data`` itself, no copy); a delta codec
    needs the decoded bytes of its ``base``."""
    if codec == NONE:
        return data
    if is_delta(codec):
        if base is None:
            raise ValueError(f"codec {codec} needs a base chunk")
        data = memoryview(xor(data, base))
    import zstandard

    width = _shuffle_width(codec)
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
