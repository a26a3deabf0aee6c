"""A checkpoint re-encoded for an older format version (spec 13.3): what ``replicate(format_version=)``
and ``ckptfmt sync --format-version`` write for a checkpoint that readers of that version cannot read.

The manifest is parsed and written again at the older version: ``Manifest`` itself picks the forms of
that version (tables as rows or columns, shard grids, generator states). A chunk stored with a codec the
version lacks (the float codecs before 1.11, the delta codecs before 1.5) is decoded, verified and stored
again with one it has: ``shuffle<N>-zstd`` (``zstd`` for other widths), what ``compression="shuffle-zstd"``
gives, and a float delta as the plain delta of the same width against the same base where the version has
delta codecs. Every other chunk keeps its row and its key, and is copied (or found) as by ``replicate``.

Why a delta chunk kept as it is stays valid when its base is stored again: a chunk's identity is the hash
of its **decoded** bytes (spec 5.4, 5.5), a delta decodes against its base's decoded bytes, and its key
names its base by that hash. Storing the base with another codec changes the base's key, neither its
hash nor its decoded bytes, so the delta row, its key and its stored bytes are the same.

What the older version cannot express at all (per-rank values before 1.1, node placement before 1.10) is
refused before anything of the checkpoint is written, naming the checkpoint, the feature and the version
that first has it. The rewritten manifest has another hash, so its commit record is new, and the source's
signatures do not sign it: they are dropped (counted), or the caller signs the new record.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import msgpack
from fsspec.callbacks import Callback, NoOpCallback

from ckptfmt.errors import CheckpointNotFoundError, CorruptDataError, UnsupportedVersionError
from ckptfmt.format import codecs, layout
from ckptfmt.format.chunk_table import Chunk, stored_key
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.features import FEATURES, first_version, version_text
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.history import HistoryKey
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.values import uses_per_rank
from ckptfmt.loading.chunkio import ChunkReader
from ckptfmt.repository.chunk_reads import read_chunk
from ckptfmt.repository.history import history_keys, read_history, read_history_bytes
from ckptfmt.repository.repository import Repository
from ckptfmt.storage.budget import ByteBudget


class CannotRewriteError(UnsupportedVersionError):
    """A checkpoint uses something the format version asked for cannot express (spec 13.3)."""


def readable_at(manifest: Manifest, version: tuple[int, int]) -> bool:
    """Whether readers of ``version`` read ``manifest`` as it is: its version is not newer, nor is any
    feature it declares (a 1.x manifest uses only what its own version has)."""
    return manifest.version <= version and all(first_version(name) <= version for name in manifest.requires
                                               if name in FEATURES)


def refuse_inexpressible(manifest: Manifest, version: tuple[int, int], where: str) -> None:
    """CannotRewriteError, one line, when ``manifest`` uses a feature that ``version`` has no form for:
    only codecs and encoded forms can be rewritten, not what the checkpoint holds."""
    found = []
    if "per-rank-values" in manifest.requires or uses_per_rank(manifest.state):
        found.append("per-rank-values")
    if manifest.placement is not None:
        found.append("node-placement")
    for name in found:
        since = first_version(name)
        if version < since:
            raise CannotRewriteError(
                f"{where}: uses {name} ({FEATURES[name].what}), which format {version_text(since)} brought; "
                f"format {version_text(version)} cannot express it (not copied)")


def codec_choices(chunk: Chunk, version: tuple[int, int]) -> list[str] | None:
    """The codecs to store ``chunk`` with again for readers of ``version``, best first; None when
    ``version`` has its codec (the chunk is copied as it is)."""
    codec = chunk.codec
    floats = codecs.is_float(codec) and version < first_version("float-codecs")
    deltas = codecs.is_delta(codec) and version < first_version("delta-codecs")
    if not (floats or deltas):
        return None
    width = _width(codec)
    whole = codecs.codec_for("shuffle-zstd", width)
    choices = [whole, codecs.ZSTD, codecs.NONE]
    if codecs.is_delta(codec) and version >= first_version("delta-codecs"):
        choices.insert(0, codecs.delta_codec_for(width))  # a float delta: the plain delta, same base
    return list(dict.fromkeys(choices))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which rows of a chunk table are stored again, and with which codec (rows absent: kept)."""

    codecs: dict[int, str]

    def key(self, chunks: list[Chunk], index: int) -> str:
        """The key row ``index`` is stored under in the rewritten checkpoint."""
        chunk = chunks[index]
        codec = self.codecs.get(index)
        if codec is None:
            return stored_key(chunks, chunk)
        base = chunks[chunk.base].hash if codecs.is_delta(codec) and chunk.base is not None else None
        return layout.chunk_key(chunk.hash, codec, base)


def plan(chunks: list[Chunk], version: tuple[int, int]) -> Plan:
    """The codec of each row ``version`` lacks; one that would take the key of another row (the same
    bytes stored whole twice, spec 6.3 forbids two rows of one object) takes the next choice."""
    kept = {index for index, chunk in enumerate(chunks) if codec_choices(chunk, version) is None}
    taken = {stored_key(chunks, chunks[index]) for index in kept}
    chosen: dict[int, str] = {}
    for index, chunk in enumerate(chunks):
        if index in kept:
            continue
        for codec in codec_choices(chunk, version) or ():
            key = Plan({index: codec}).key(chunks, index)
            if key not in taken:
                taken.add(key)
                chosen[index] = codec
                break
        else:  # every choice is another row's object: cannot happen with fewer than four copies of a chunk
            raise CorruptDataError(f"chunk {index} ({chunk.hash[:16]}...) is listed too many times to store again")
    return Plan(chosen)


class Reencoder:
    """Stores chunks again with the codecs of a plan; remembers what it stored across checkpoints."""

    def __init__(self, source: Repository, target: Repository, workers: int, verify: bool, budget: ByteBudget,
                 stored: dict[str, int], yield_to: Callable[[], object] | None = None,
                 progress: Callback | None = None):
        self.source = source
        self.target = target
        self.workers = workers
        self.verify = verify
        self.budget = budget
        #: The target's chunk keys and sizes as listed (its objects may be damaged: checked before use).
        self.stored = stored
        self.yield_to = yield_to
        #: Counts each row's source bytes once it is stored again or found (fsspec).
        self.progress = progress or NoOpCallback()
        #: Keys stored again or found intact by this object, and their stored sizes.
        self.done: dict[str, int] = {}
        self.lock = threading.Lock()
        self.chunks_written = self.bytes_written = self.chunks_found = self.bytes_found = 0

    def pending_bytes(self, chunks: list[Chunk], chosen: Plan) -> int:
        """The source's stored bytes of the plan's rows not stored yet, each object once: what ``run`` counts."""
        keys = {chosen.key(chunks, index): chunks[index].stored_size for index in chosen.codecs}
        return sum(size for key, size in keys.items() if key not in self.done)

    def run(self, chunks: list[Chunk], chosen: Plan) -> list[Chunk]:
        """The chunk table with the plan's rows stored again (made durable) and their new stored sizes."""
        reader = ChunkReader(self.source.storage, chunks)
        rows = sorted(chosen.codecs)
        written: list[str] = []
        found: list[str] = []

        def one(index: int) -> tuple[int, int]:
            size, fresh = self._store(reader, chunks, index, chosen)
            (written if fresh else found).append(chosen.key(chunks, index))
            return index, size

        with ThreadPoolExecutor(self.workers, thread_name_prefix="ckptfmt-rewrite") as pool:
            futures = []
            for index in rows:
                if self.yield_to is not None:
                    self.yield_to()
                futures.append(pool.submit(one, index))
            sizes = dict(future.result() for future in futures)
        self.target.storage.sync(written)
        self.target.storage.make_durable(found)
        table = list(chunks)
        for index, size in sizes.items():
            chunk, codec = chunks[index], chosen.codecs[index]
            table[index] = chunk._replace(codec=codec, stored_size=size,
                                          base=chunk.base if codecs.is_delta(codec) else None)
        return table

    def _store(self, reader: ChunkReader, chunks: list[Chunk], index: int, chosen: Plan) -> tuple[int, bool]:
        """Row ``index`` stored with its new codec: its stored size, and whether it was written."""
        chunk, codec = chunks[index], chosen.codecs[index]
        key = chosen.key(chunks, index)
        base_index = chunk.base if codecs.is_delta(codec) else None
        with self.lock:
            if key in self.done:  # counted when it was stored
                return self.done[key], False
        with self.budget.take(3 * chunk.size):
            data = reader.read(index)  # decoded and verified, through its bases
            base = None if base_index is None else reader.read(base_index)
            size = self.stored.get(key)
            if size is not None and self._intact(key, chunk, codec, size, base):
                with self.lock:
                    self.done[key] = size
                    self.chunks_found += 1
                    self.bytes_found += size
                self.progress.relative_update(chunk.stored_size)
                return size, False
            stored = bytes(codecs.encode(codec, memoryview(data), base))
            del data
            self.target.storage.write(key, stored, durable=False)
            if self.verify:
                self._check_arrival(key, chunk, codec, stored, base)
        with self.lock:
            self.done[key] = len(stored)
            self.chunks_written += 1
            self.bytes_written += len(stored)
        self.progress.relative_update(chunk.stored_size)
        return len(stored), True

    def _intact(self, key: str, chunk: Chunk, codec: str, size: int, base: bytes | memoryview | None) -> bool:
        """Whether the target's object at ``key`` decodes to the chunk (any stored size: this call writes the
        manifest that will name it)."""
        if size > chunk.size + 2**20 + chunk.size // 8:  # more than any frame of it: damaged
            return False
        row = Chunk(chunk.hash, codec, chunk.size, size, None)
        try:
            read_chunk(self.target.storage, key, row, base=base)
        except (CorruptDataError, CheckpointNotFoundError):
            return False
        return True

    def _check_arrival(self, key: str, chunk: Chunk, codec: str, stored: bytes,
                       base: bytes | memoryview | None) -> None:
        """Read the new object back and decode it against the chunk's hash."""
        try:
            read_chunk(self.target.storage, key, Chunk(chunk.hash, codec, chunk.size, len(stored), None), base=base)
        except CorruptDataError as exc:
            self.target.storage.delete(key)
            raise CorruptDataError(f"{exc} (removed)") from None


def rewritten(manifest: Manifest, chunks: list[Chunk], version: tuple[int, int],
              where: str) -> tuple[bytes, Manifest]:
    """The manifest for readers of ``version`` with chunk table ``chunks``: its bytes, and those bytes
    parsed back (never commit what readers refuse)."""
    totals = dict(manifest.totals)
    if "stored_bytes" in totals:
        totals["stored_bytes"] = sum(c.stored_size for c in chunks)
    new = dataclasses.replace(manifest, chunks=chunks, version=version, totals=totals)
    data = new.to_bytes()
    return data, Manifest.from_bytes(data, where)


def record_for(record: CommitRecord, data: bytes, version: tuple[int, int]) -> CommitRecord:
    """The commit record of the rewritten manifest ``data``: the source's, with the new manifest."""
    return dataclasses.replace(record, manifest_hash=chunk_hash(data), manifest_size=len(data), version=version,
                               parity=None)  # the parity of the manifest it replaces protects none of this one


def same_checkpoint(source: Manifest, theirs: Manifest, version: tuple[int, int]) -> bool:
    """Whether ``theirs`` is ``source`` as rewritten for ``version`` (by an earlier sync): readable at
    ``version``, the same chunks (by decoded identity), state, values and tensors."""
    return (readable_at(theirs, version) and theirs.created_ns == source.created_ns
            and theirs.step == source.step and theirs.parent == source.parent
            and [(c.hash, c.size) for c in theirs.chunks] == [(c.hash, c.size) for c in source.chunks]
            and theirs.state == source.state and theirs.user == source.user
            and [(t.key, t.dtype, t.shape) for t in theirs.tensors] == [(t.key, t.dtype, t.shape)
                                                                        for t in source.tensors])


def copy_histories_at(source: Repository, target: Repository, version: tuple[int, int]) -> int:
    """The source's history objects (spec 4.5) that ``target`` lacks, for readers of ``version``: as they
    are when not newer, else written again at ``version`` (under the key of their new bytes). How many."""
    present = {(key.name, key.created_ns) for key in history_keys(target)}
    copied = 0
    for key in history_keys(source):
        if (key.name, key.created_ns) in present:
            continue
        data = read_history_bytes(source, key)
        if tuple(_version_of(data)) > version:
            data = read_history(source, key).to_bytes(version)
            key = HistoryKey(key.created_ns, key.name, chunk_hash(data))
        target.storage.write(key.key, data)
        read_history(target, key)
        present.add((key.name, key.created_ns))
        copied += 1
    return copied


def _width(codec: str) -> int:
    """The element width N of a codec named ``<kind><N>-zstd`` (1 for the others)."""
    digits = "".join(c for c in codec.removesuffix("-zstd") if c.isdigit())
    return int(digits) if digits else 1


def _version_of(data: bytes) -> Iterable[int]:
    doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return doc["version"]


__all__ = ["CannotRewriteError", "Plan", "Reencoder", "codec_choices", "copy_histories_at", "plan", "readable_at",
           "record_for", "refuse_inexpressible", "rewritten", "same_checkpoint"]
