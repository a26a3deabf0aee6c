"""BLAKE3 hashing of chunk bytes: the identity of every chunk and the check on every read."""

from __future__ import annotations

import blake3

from ckptfmt.errors import CorruptDataError

#: Above this size one hash call spreads over all cores (BLAKE3's own threads).
_PARALLEL_THRESHOLD = 8 * 2**20


def chunk_hash(data, *, parallel: bool = False) -> str:
    """Hex BLAKE3-256 of ``data`` (any buffer). ``parallel`` uses all cores on large inputs."""
    threads = blake3.blake3.AUTO if parallel and len(memoryview(data).cast("B")) >= _PARALLEL_THRESHOLD else 1
    return blake3.blake3(data, max_threads=threads).hexdigest()


def check_chunk(data, expected: str, where: str, *, parallel: bool = False) -> None:
    """Raise CorruptDataError naming ``where`` unless ``data`` hashes to ``expected``."""
    actual = chunk_hash(data, parallel=parallel)
    if actual != expected:
        raise CorruptDataError(f"{where}: hash mismatch (expected {expected[:16]}..., got {actual[:16]}...)")
