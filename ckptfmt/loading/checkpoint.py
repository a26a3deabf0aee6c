"""A committed checkpoint as its manifest describes it, and its tensors as raw bytes: what ``ckptfmt show``,
``diff`` and the TUI read, with no torch (``loading/reader.py``'s ``CheckpointReader`` builds torch
tensors on top)."""

from __future__ import annotations

import difflib
import os
from typing import TYPE_CHECKING, TypeVar

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CorruptDataError
from ckptfmt.format.dtypes import itemsize
from ckptfmt.format.manifest import Manifest, TensorEntry
from ckptfmt.format.signatures import Signature, TrustedKeys, trusted_public_keys
from ckptfmt.format.values import MakeTorchValue, TorchValue, decode_tree
from ckptfmt.loading.chunkio import ChunkReader
from ckptfmt.loading.healing import ChunkHealer, HealFrom
from ckptfmt.loading.verified_files import VerifyMode, check_verify_mode
from ckptfmt.repository.repository import CommitRecord, Repository, resolve
from ckptfmt.repository.signatures import check_signed

if TYPE_CHECKING:
    import numpy as np

_Self = TypeVar("_Self", bound="Checkpoint")


class Checkpoint:
    """A committed checkpoint's commit record, manifest, metadata and tensor table.

    ``trusted_keys``: public keys (Ed25519, ML-DSA-65 or hybrid); the checkpoint opens only if one of
    them signed it (spec 10.3), else SignatureError names it.
    """

    #: What torch dtypes, Sizes and devices in the value trees decode to (``format.values``).
    torch_value: MakeTorchValue = TorchValue

    def __init__(self, repository: Repository, name: str, *, trusted_keys: TrustedKeys = None,
                 heal_from: HealFrom = None, read: tuple[CommitRecord, Manifest] | None = None,
                 verify: VerifyMode = True):
        """``read``: the checkpoint's commit record and whole manifest, where the caller has read them;
        ``verify``: how chunks are checked as they are read (``ckptfmt.load``)."""
        self.repository, self.name = repository, name
        self.commit = repository.commit(name) if read is None else read[0]
        #: The trusted key's signature that vouches for this checkpoint (None: no key was given to check).
        self.signature: Signature | None = None if trusted_keys is None else check_signed(
            repository, self.commit, trusted_public_keys(trusted_keys))
        self.manifest: Manifest = repository.manifest(name, self.commit) if read is None else read[1]
        #: key -> index in the tensor table, built at the first lookup: a listing needs none (100,000 keys
        #: take 15 ms to index, twice msgpack's unpack of the whole manifest). Entries are built when read.
        self._index: dict[str, int] | None = None
        self._chunks = ChunkReader(repository.storage, self.manifest.chunks, ChunkHealer.of(heal_from),
                                   check_verify_mode(verify))

    @classmethod
    def open(cls, url: str | os.PathLike, *, storage_options: dict | None = None,
             trusted_keys: TrustedKeys = None) -> Checkpoint:
        """The checkpoint at ``url`` (REPO/NAME, a repository for its latest, or a pointer file's path)."""
        repository, name = resolve(url, storage_options)
        return cls(repository, name, trusted_keys=trusted_keys)

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop cached chunks and memory maps (arrays and tensors already returned stay valid); wait for the
        repairs of chunks read from ``heal_from``."""
        self._chunks.clear()
        if self._chunks.healer is not None:
            self._chunks.healer.finish()

    @property
    def url(self) -> str:
        return self.repository.storage.describe(self.name)

    @property
    def id(self) -> str:
        """The BLAKE3 hash of the manifest: identifies this checkpoint's exact content."""
        return self.commit.manifest_hash

    def keys(self) -> list[str]:
        """Every tensor's key (path segments joined by '/'), in save order."""
        return self.manifest.tensors.keys()

    def __contains__(self, key: str) -> bool:
        return key in self._positions()

    def _positions(self) -> dict[str, int]:
        """The index of every key (two threads may both build it: the same dict either way)."""
        index = self._index
        if index is None:
            keys = self.manifest.tensors.keys()
            index = self._index = dict(zip(keys, range(len(keys))))
        return index

    def tensor_info(self, key: str) -> TensorEntry:
        """Dtype, shape, shards and chunk references of one tensor, without reading it."""
        return self.manifest.tensors[self.lookup(key)]

    def tensor_stats(self, key: str) -> dict | None:
        """The statistics of one tensor's elements as its writer recorded them (spec 6.10: count, min,
        max, mean, l2, absmax, nan, posinf, neginf, zeros), without reading it; None where not recorded.
        A tensor that is the same object as an earlier one (tied weights) has that one's. The caller's own
        dict: changing it changes no manifest."""
        entry = self.manifest.tensors[self.lookup(key)]
        if entry.same_as is not None:
            entry = self.manifest.tensors[entry.same_as]
        return None if entry.stats is None else dict(entry.stats)

    def lookup(self, key: str) -> int:
        """The tensor table's index of ``key``; CheckpointNotFoundError with a "did you mean" otherwise."""
        index = self._positions()
        try:
            return index[key]
        except KeyError:
            near = difflib.get_close_matches(key, index, n=3)
            hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
            raise CheckpointNotFoundError(f"{self.url}: no tensor {key!r}{hint}") from None

    @property
    def metadata(self) -> dict:
        """Run metadata: step, environment, rng, topology, timing, user, and more."""
        m = self.manifest
        return {
            "name": m.name,
            "step": m.step,
            "created_ns": m.created_ns,
            "parent": m.parent,
            "format_version": list(m.version),
            "environment": m.environment,
            "rng": m.rng,
            "topology": m.topology,
            "timing": m.timing,
            "stats": m.totals,
            "user": decode_tree(m.user, torch_value=type(self).torch_value),
            "provenance": m.provenance,
            **({"replicas": m.replicas} if m.replicas is not None else {}),
            **({"placement": {"scope": "node", "chunk_count": len(m.chunks),
                              "nodes": [{"host": node.host, "ranks": list(node.ranks), "chunks": len(node.rows)}
                                        for node in m.placement.nodes]}} if m.placement is not None else {}),
            **({"extra": m.extra} if m.extra else {}),
        }

    def read_array(self, key: str) -> np.ndarray:
        """Tensor ``key``'s bytes, every chunk verified, as a numpy array of its global shape whose elements
        are raw items (``V<itemsize>``): no torch; ``format.dtypes.numeric`` views it as numbers where numpy
        has the dtype. A sharded tensor's shards are put in their places."""
        import numpy as np  # only to read tensors: showing one needs none

        entry = self.manifest.tensors[self.lookup(key)]
        if entry.same_as is not None:
            entry = self.manifest.tensors[entry.same_as]
        item = np.dtype(f"V{itemsize(entry.dtype)}")
        try:
            array = np.empty(entry.shape, dtype=item)
        except (MemoryError, ValueError) as exc:
            raise CheckpointError(f"{self.url}: cannot allocate tensor {entry.key!r}: {exc}") from None
        try:
            for shard in entry.shards:
                raw = bytearray()
                for piece in shard.pieces:
                    data = memoryview(self._chunks.read(piece.chunk))
                    raw += data[piece.offset : piece.offset + piece.length]
                box = tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.shape))
                array[box] = np.frombuffer(raw, dtype=item).reshape(shard.shape)
        except (CorruptDataError, CheckpointNotFoundError) as exc:
            raise type(exc)(f"{self.url}: tensor {entry.key!r}: {exc}") from None
        return array
