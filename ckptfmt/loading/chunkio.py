"""Reading chunks back: every byte checked against its BLAKE3 name before use; with a healer, a chunk
missing or damaged here is read from another repository (``healing.py``)."""

from __future__ import annotations

import functools
import mmap
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from ckptfmt.errors import CheckpointNotFoundError, CorruptDataError
from ckptfmt.format import codecs
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.format.hashing import check_chunk
from ckptfmt.format.manifest import Chunk
from ckptfmt.loading import verified_files
from ckptfmt.loading.healing import ChunkHealer
from ckptfmt.loading.verified_files import VerifyMode
from ckptfmt.repository.chunk_reads import missing_chunk_named, read_chunk
from ckptfmt.storage.base import Storage

_CACHE_BYTES = 64 * 2**20


class ChunkReader:
    """Verified chunk reads, with a small shared cache for chunks several tensors use (packs)."""

    def __init__(self, storage: Storage, chunks: list[Chunk], healer: ChunkHealer | None = None,
                 verify: VerifyMode = True, *, remember: bool = False):
        self.storage = storage
        self.chunks = chunks
        self.healer = healer
        #: True: every read is hashed; "once": not a local file this process has checked already
        #: (``verified_files``); False: no read is (sizes are still checked).
        self.verify = verify
        #: Whether the local files found right are remembered (``verify="once"`` does; ``ckptfmt.verify`` too).
        self.remember = remember or verify == "once"
        #: Chunks found damaged here, with what was wrong: read from elsewhere by the healer from then on.
        self._damaged: dict[int, CheckpointNotFoundError | CorruptDataError] = {}
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cached_bytes = 0
        self._maps: OrderedDict[int, mmap.mmap | None] = OrderedDict()
        self._loading: dict[tuple[int, int], Future] = {}
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Drop cached chunks and maps (tensors built on a map keep it alive themselves)."""
        with self._lock:
            self._cache.clear()
            self._cached_bytes = 0
            self._maps.clear()

    def can_read_into(self, index: int, length: int) -> bool:
        """Whether a piece covering all of chunk ``index`` can be read straight into its target."""
        chunk = self.chunks[index]
        return self.storage.zero_copy_reads and chunk.codec == codecs.NONE and chunk.size == length

    def check_stored_size(self, index: int) -> None:
        """Refuse a chunk whose stored object is not its row's ``stored_size``, without reading it."""
        chunk = self.chunks[index]
        key = stored_key(self.chunks, chunk)
        actual = self.storage.size(key)
        if actual is None:
            raise CheckpointNotFoundError(f"{self.storage.describe(key)}: chunk is missing")
        if actual != chunk.stored_size:
            raise CorruptDataError(f"{self.storage.describe(key)}: {actual} bytes stored, manifest says "
                                   f"{chunk.stored_size}")

    def read_into(self, index: int, target: memoryview, *, parallel: bool = False) -> None:
        """Read an uncompressed chunk straight into ``target`` (its exact size), then verify it."""
        chunk = self.chunks[index]
        key = stored_key(self.chunks, chunk)
        if index in self._damaged:
            target[:] = self._heal(index, None)
            return
        try:
            file = self._identity(key)
            with missing_chunk_named(self.storage, key):
                self.storage.read_into(key, target)
            self._check(target, chunk, key, file, parallel)
        except (CheckpointNotFoundError, CorruptDataError) as exc:
            target[:] = self._heal(index, exc)

    def read(self, index: int, *, parallel: bool = False) -> bytes | memoryview:
        """The decoded, verified bytes of chunk ``index`` (cached while small chunks are reused)."""
        return self._once(self._cache, index, lambda: self._fetch(index, parallel), small_only=True)

    def mapped(self, index: int, *, parallel: bool = False) -> mmap.mmap | None:
        """A copy-on-write memory map of an uncompressed chunk, verified unless ``verify`` is False, or None
        if not mappable.

        Tensors built on it share the page cache instead of copying into fresh
        memory; the mapping stays valid even if the file is later unlinked.
        Every caller gets the one map kept for the chunk.
        """
        try:  # one lookup for each tensor after its chunk's first (atomic: a close may clear the maps)
            return self._maps[index]
        except KeyError:
            pass
        if self.verify is False:
            # Nothing to hash, so nothing to do once: threads asking at the same time may each map the file
            # (cheap), and the first map stored is the one every caller gets. ``_once``'s Future and two more
            # rounds of the lock a chunk were 6% of an unverified load of 99 tensors.
            mapping = self._map(index, parallel)
            with self._lock:
                return self._maps.setdefault(index, mapping)
        return self._once(self._maps, index, lambda: self._map(index, parallel), small_only=False)

    def windows_reader(self, index: int) -> Callable[[Sequence[int], int], bytes | None] | None:
        """What reads, when called with ``starts`` and ``length``, that many bytes at each start of chunk
        ``index``'s file, joined, unhashed (no page of a map of it touched): the storage and chunk table
        only, no map or cache kept alive, and the key made at the call. None where the chunk is not
        stored whole; the call gives None where the storage has no cheap reads."""
        chunk = self.chunks[index]
        if chunk.codec != codecs.NONE or chunk.base is not None:
            return None
        return functools.partial(_read_windows, self.storage, self.chunks, index)

    def _once(self, cache: OrderedDict, index: int, load, *, small_only: bool):
        """Load ``index`` once even when several threads ask at the same time; cache the result."""
        with self._lock:
            if index in cache:
                cache.move_to_end(index)
                return cache[index]
            loading = self._loading.get((id(cache), index))
            if loading is None:
                future: Future = Future()
                self._loading[(id(cache), index)] = future
        if loading is not None:  # another thread loads it: wait for its result
            return loading.result()
        try:
            data = load()
        except BaseException as exc:
            future.set_exception(exc)
            with self._lock:
                del self._loading[(id(cache), index)]
            raise
        future.set_result(data)
        with self._lock:
            del self._loading[(id(cache), index)]
            size = len(data) if data is not None else 0
            if not small_only:
                cache[index] = data
            elif size <= _CACHE_BYTES // 8:
                cache[index] = data
                self._cached_bytes += size
                while self._cached_bytes > _CACHE_BYTES:
                    _, evicted = cache.popitem(last=False)
                    self._cached_bytes -= len(evicted)
        return data

    def _map(self, index: int, parallel: bool) -> mmap.mmap | None:
        chunk = self.chunks[index]
        if chunk.codec != codecs.NONE:
            return None
        key = stored_key(self.chunks, chunk)
        if index in self._damaged:
            return None
        try:
            file = self._identity(key)
            with missing_chunk_named(self.storage, key):
                mapping = self.storage.map(key, chunk.size)
            if mapping is not None:
                self._check(mapping, chunk, key, file, parallel)
        except (CheckpointNotFoundError, CorruptDataError) as exc:
            if self.healer is None:
                raise
            self._damaged[index] = exc  # read into memory instead, from elsewhere (read, read_into)
            return None
        return mapping

    def _fetch(self, index: int, parallel: bool) -> bytes | memoryview:
        if index in self._damaged:
            return self._heal(index, None)
        try:
            return self._fetch_here(index, parallel)
        except (CheckpointNotFoundError, CorruptDataError) as exc:
            return self._heal(index, exc)

    def _fetch_here(self, index: int, parallel: bool) -> bytes | memoryview:
        chunk = self.chunks[index]
        key = stored_key(self.chunks, chunk)
        base = self._base(index, self.storage.describe(key))
        file = self._identity(key)
        hashed = not self._skips(file)
        decoded = read_chunk(self.storage, key, chunk, base=base, parallel=parallel, verify=hashed).decoded
        if hashed:
            verified_files.remember(file)
        return decoded

    def _identity(self, key: str) -> verified_files.FileIdentity | None:
        """Where checked files are remembered: the chunk file as it is before it is read (else None)."""
        return verified_files.identity(self.storage, key) if self.remember else None

    def would_hash(self, index: int) -> bool:
        """Whether reading chunk ``index`` now would hash it (under ``"once"``: its file not checked yet)."""
        return not self._skips(self._identity(stored_key(self.chunks, self.chunks[index])))

    def _skips(self, file: verified_files.FileIdentity | None) -> bool:
        """Whether ``verify`` lets this read go unhashed."""
        return self.verify is False or (self.verify == "once" and verified_files.known(file))

    def _check(self, data, chunk: Chunk, key: str, file: verified_files.FileIdentity | None, parallel: bool) -> None:
        """Hash ``data`` against the chunk's name, unless ``verify`` says it need not be."""
        if self._skips(file):
            return  # nor read ahead: a map's pages are read as its tensors touch them (18 us a warm map)
        if isinstance(data, mmap.mmap) and hasattr(data, "madvise"):
            data.madvise(mmap.MADV_WILLNEED)  # start reading the whole file ahead of the hash
        check_chunk(data, chunk.hash, self.storage.describe(key), parallel=parallel)
        verified_files.remember(file)

    def _base(self, index: int, where: str) -> bytes | memoryview | None:
        """The decoded bytes of a delta chunk's base (read, verified and decoded through its own bases);
        None for a chunk stored whole. A base that cannot be read is named with the delta."""
        base = self.chunks[index].base
        if base is None:
            return None
        try:
            return self.read(base)
        except (CheckpointNotFoundError, CorruptDataError) as exc:
            raise type(exc)(f"{where}: its base chunk cannot be read: {exc}") from None

    def _heal(self, index: int, damage: CheckpointNotFoundError | CorruptDataError | None) -> bytes | memoryview:
        """Chunk ``index`` from the healer, this copy found damaged (``damage``; None: found so before)."""
        damage = damage or self._damaged[index]
        if self.healer is None:
            raise damage
        self._damaged[index] = damage
        chunk = self.chunks[index]
        base = None if chunk.base is None else (self.chunks[chunk.base].hash, self.read(chunk.base))
        return self.healer.replacement(self.storage, chunk, damage, stored_key(self.chunks, chunk), base)


def _read_windows(storage: Storage, chunks: list[Chunk], index: int, starts: Sequence[int],
                  length: int) -> bytes | None:
    """``ChunkReader.windows_reader``'s call."""
    return storage.read_windows(stored_key(chunks, chunks[index]), starts, length)
