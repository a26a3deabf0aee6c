"""Skip re-hashing unchanged tensors between saves in one process.

BLAKE3 runs at ~4 GB/s per core here, too slow to re-hash a whole state when
only a tenth of it changed. For chunks that view a caller's tensor memory
directly, we remember (address, length) -> (XXH3-128 of the bytes, BLAKE3).
At the next save a matching XXH3 (~25 GB/s) proves, short of a 2**-128 accident,
that the bytes are the ones hashed before. Nothing is trusted without reading
every byte; ``ckptfmt verify`` re-checks every chunk with BLAKE3 anyway.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import xxhash

_MAX_ENTRIES = 200_000


class HashCache:
    """A bounded, thread-safe map from memory ranges to their content hashes."""

    def __init__(self, max_entries: int = _MAX_ENTRIES):
        self._entries: OrderedDict[tuple[int, int], tuple[bytes, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._max = max_entries

    def lookup(self, data: memoryview, address: int) -> tuple[bytes, str | None, bool]:
        """(XXH3 fingerprint of ``data``, the digest remembered for these exact bytes or None,
        whether ``address`` was remembered at all)."""
        fingerprint = xxhash.xxh3_128_digest(data)
        with self._lock:
            known = self._entries.get((address, len(data)))
        if known is not None and known[0] == fingerprint:
            return fingerprint, known[1], True
        return fingerprint, None, known is not None

    def remember(self, address: int, length: int, fingerprint: bytes, digest: str) -> None:
        """Record that the ``length`` bytes at ``address`` with this fingerprint hash to ``digest``.

        Callers must have computed both over the same bytes (one private copy,
        or a fingerprint taken again after hashing that came out equal).
        """
        key = (address, length)
        with self._lock:
            self._entries[key] = (fingerprint, digest)
            self._entries.move_to_end(key)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)


#: Shared by every save of this process.
DEFAULT_CACHE = HashCache()
