"""Chunk codecs: how a chunk's bytes are encoded on storage.

A chunk is always named by the BLAKE3 hash of its *decoded* bytes, so the codec
changes where it is stored (the key's suffix) but never its identity.

Codecs: ``none`` (the default: on fp32 weights zstd gains ~1.08x and is slower
than the disk), ``zstd``, and ``shuffleN-zstd`` (a byte-shuffle over N-byte
elements, then zstd; helps bf16/fp16 and deltas).
"""

from __future__ import annotations

import numpy as np
import zstandard

from ckptfmt.errors import CorruptDataError, ManifestError, quoted

NONE = "none"
ZSTD = "zstd"
_SHUFFLE_WIDTHS = (2, 4, 8)
CODECS = frozenset({NONE, ZSTD, *(f"shuffle{w}-zstd" for w in _SHUFFLE_WIDTHS)})
ZSTD_LEVEL = 1


def check_codec(codec: object) -> str:
    """Return ``codec`` if this reader knows it, else raise ManifestError."""
    if codec not in CODECS:
        raise ManifestError(f"unknown chunk codec {quoted(codec)}")
    return codec


def codec_for(compression: str | None, itemsize: int) -> str:
    """The codec a writer uses for ``compression`` (None, 'zstd' or 'shuffle-zstd')."""
    if compression in (None, NONE):
        return NONE
    if compression == ZSTD:
        return ZSTD
    if compression == "shuffle-zstd":
        return f"shuffle{itemsize}-zstd" if itemsize in _SHUFFLE_WIDTHS else ZSTD
    raise ValueError(f"unknown compression {compression!r}: use None, 'zstd' or 'shuffle-zstd'")


def _shuffle_width(codec: str) -> int:
    return int(codec[len("shuffle") : -len("-zstd")]) if codec.startswith("shuffle") else 1


def _shuffle(data: memoryview, width: int) -> bytes:
    """Byte-shuffle: all first bytes of each element, then all second bytes, ... (tail kept)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    whole = len(raw) - len(raw) % width
    body = raw[:whole].reshape(-1, width).T.tobytes()
    return body + raw[whole:].tobytes()


def _unshuffle(data: bytes, width: int) -> bytes:
    raw = np.frombuffer(data, dtype=np.uint8)
    whole = len(raw) - len(raw) % width
    body = raw[:whole].reshape(width, -1).T.tobytes()
    return body + raw[whole:].tobytes()


def encode(codec: str, data: memoryview) -> memoryview | bytes:
    """Encode decoded chunk bytes for storage (``none`` returns ``data`` itself, no copy)."""
    if codec == NONE:
        return data
    width = _shuffle_width(codec)
    payload = _shuffle(data, width) if width > 1 else data
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(payload)


def decode(codec: str, stored: bytes, size: int, where: str) -> bytes | memoryview:
    """Decode stored bytes into exactly ``size`` bytes; raises CorruptDataError naming ``where``."""
    if codec == NONE:
        if len(stored) != size:
            raise CorruptDataError(f"{where}: {len(stored)} bytes stored, manifest says {size}")
        return stored
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
    return _unshuffle(data, width) if width > 1 else data
