"""Skip re-hashing unchanged tensors between saves in one process.

BLAKE3 runs at ~4 GB/s per core here, too slow to re-hash a whole state when
only a tenth of it changed. For chunks that view a caller's tensor memory
directly, we remember (address, length) -> (XXH3-128 of the bytes, BLAKE3).
At the next save a matching XXH3 (~25 GB/s) proves, short of a 2**-128 accident,
that the bytes are the ones hashed before. Nothing is trusted without reading
every byte; ``ckptfmt verify`` re-checks every chunk with BLAKE3 anyway. The
bytes' tensor statistics (format/tensor_stats.py) are remembered with their
hash, so unchanged bytes cost neither a hash nor a statistics pass.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import xxhash

_MAX_ENTRIES = 200_000


class Known(NamedTuple):
    """What a lookup found for a memory range."""

    #: XXH3-128 of the bytes there now.
    fingerprint: bytes
    #: Their BLAKE3 digest, if these exact bytes were hashed before; else None.
    digest: str | None
    #: Their statistics as elements of ``dtype`` (see ``remember``), when remembered; else None.
    stats: dict[str, Any] | None
    #: Whether the range was remembered at all (with other bytes, maybe).
    seen: bool


class HashCache:
    """A bounded, thread-safe map from memory ranges to their content hashes and statistics."""

    def __init__(self, max_entries: int = _MAX_ENTRIES):
        self._entries: OrderedDict[tuple[int, int], tuple[bytes, str, Any, dict | None]] = OrderedDict()
        self._lock = threading.Lock()
        self._max = max_entries

    def lookup(self, data: memoryview, address: int, dtype: Any = None) -> Known:
        """What is known of ``data``, the bytes at ``address``; statistics only if remembered for
        ``dtype`` (the same bytes read as another dtype have other statistics)."""
        fingerprint = xxhash.xxh3_128_digest(data)
        with self._lock:
            known = self._entries.get((address, len(data)))
        if known is not None and known[0] == fingerprint:
            return Known(fingerprint, known[1], known[3] if known[2] == dtype else None, True)
        return Known(fingerprint, None, None, known is not None)

    def remember(self, address: int, length: int, fingerprint: bytes, digest: str, *, dtype: Any = None,
                 stats: dict[str, Any] | None = None) -> None:
        """Record that the ``length`` bytes at ``address`` with this fingerprint hash to ``digest``
        (and, read as ``dtype``, have the statistics ``stats``).

        Callers must have computed all of them over the same bytes (one private
        copy, or a fingerprint taken again after hashing that came out equal).
        """
        key = (address, length)
        with self._lock:
            self._entries[key] = (fingerprint, digest, dtype, stats)
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)


#: Shared by every save of this process.
DEFAULT_CACHE = HashCache()
