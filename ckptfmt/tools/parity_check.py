"""Checking a checkpoint's parity (spec 5.6) and saying, for each damaged object, whether parity rebuilds it.

``verify`` reads every parity object a checkpoint's record names (each is named by its hash) and every
copy of the record; ``repair`` uses the same findings to decide what to rebuild.
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fsspec.callbacks import Callback, NoOpCallback

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CorruptDataError, StorageError
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.parity_record import ParityRecord, parity_digest
from ckptfmt.repository import parity as stored_parity
from ckptfmt.repository.protection import erasures, rebuildable
from ckptfmt.storage.base import Storage


@dataclass
class ParityCheck:
    """What was found of one checkpoint's parity."""

    name: str
    digest: str
    record: ParityRecord | None = None
    #: Why no copy of the record could be read (then nothing can be rebuilt).
    error: str | None = None
    #: Copies of the record that are missing or damaged: (key, what is wrong).
    damaged_copies: tuple[tuple[str, str], ...] = ()
    #: Parity objects missing or damaged: key -> what is wrong.
    bad_parity: dict[str, str] = field(default_factory=dict)
    bytes_checked: int = 0

    @functools.cached_property
    def _indices(self) -> dict[str, int]:
        return {key: i for i, (key, _) in enumerate(self.record.objects)} if self.record is not None else {}

    def index(self, key: str) -> int | None:
        """The record's index of protected object ``key``, None when it does not protect it."""
        return self._indices.get(key)

    def verdict(self, lost_keys: set[str]) -> dict[str, str]:
        """For each of ``lost_keys`` (and each bad parity object, by key), whether parity rebuilds it: a
        short text for messages."""
        if self.record is None:
            return {key: f"parity cannot rebuild it ({self.error})" for key in lost_keys}
        lost = {i for key in lost_keys if (i := self.index(key)) is not None}
        objects, parity = rebuildable(self.record, lost, set(self.bad_parity))
        counts = erasures(self.record, lost, set(self.bad_parity))
        code = f"{self.record.k}+{self.record.m}"

        def cannot(stripes: list[int]) -> str:
            return f"parity {code} cannot rebuild it: a stripe of it lost {max(counts[s] for s in stripes)} pieces"

        out = {}
        for key in lost_keys:
            i = self.index(key)
            if i is None:
                out[key] = "parity does not cover it"
            else:
                out[key] = f"parity {code} can rebuild it" if i in objects else cannot(
                    [s for s, stripe in enumerate(self.record.stripes) if any(p.obj == i for p in stripe.pieces)])
        for key in self.bad_parity:
            out[key] = f"parity {code} can rebuild it" if key in parity else cannot(
                [s for s, stripe in enumerate(self.record.stripes) if key in stripe.keys])
        return out


def check_parity(storage: Storage, name: str, digest: str, *, workers: int = 8,
                 callback: Callback | None = None) -> ParityCheck:
    """Read checkpoint ``name``'s parity record (every copy) and every parity object it names."""
    callback = callback or NoOpCallback()
    check = ParityCheck(name, digest)
    try:
        found = stored_parity.read_record(storage, name, digest)
    except StorageError:
        raise
    except CheckpointError as exc:
        check.error = str(exc)
        return check
    check.record, check.damaged_copies = found.record, found.damaged
    lengths: dict[str, int] = {}
    for stripe in found.record.stripes:
        for key in stripe.keys:
            lengths.setdefault(key, stripe.length)

    def read(item: tuple[str, int]) -> tuple[str, str | None]:
        key, length = item
        try:
            read_parity(storage, key, length)
            return key, None
        except StorageError:
            raise
        except CheckpointNotFoundError:
            return key, f"{storage.describe(key)}: parity object is missing"
        except CheckpointError as exc:
            return key, str(exc)
        finally:
            callback.relative_update(length)

    callback.set_size((callback.size or 0) + sum(lengths.values()))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptfmt-parity-check") as pool:
        for key, problem in pool.map(read, sorted(lengths.items())):
            if problem is not None:
                check.bad_parity[key] = problem
    check.bytes_checked = sum(lengths.values())
    return check


def read_parity(storage: Storage, key: str, length: int) -> bytes:
    """Parity object ``key`` of a stripe of ``length`` bytes, checked against its name: any other size, or
    other bytes, is damage."""
    data = storage.read(key, max_size=length)
    if len(data) != length:
        raise CorruptDataError(f"{storage.describe(key)}: parity object is damaged ({len(data)} bytes, "
                               f"{length} expected)")
    if chunk_hash(data) != parity_digest(key):
        raise CorruptDataError(f"{storage.describe(key)}: parity object is damaged (hash mismatch)")
    return data


def annotate(problems: list, checks: dict[str, ParityCheck]) -> list:
    """``problems`` (verify's), each damaged object of a protected checkpoint saying whether parity
    rebuilds it (its ``parity`` member)."""
    lost: dict[str, set[str]] = {}
    for problem in problems:
        if problem.checkpoint in checks and problem.key is not None:
            lost.setdefault(problem.checkpoint, set()).add(problem.key)
    verdicts = {name: check.verdict(lost.get(name, set())) for name, check in checks.items()}
    return [dataclasses.replace(p, parity=verdicts[p.checkpoint].get(p.key)) if p.checkpoint in verdicts
            and p.key is not None else p for p in problems]


__all__ = ["ParityCheck", "annotate", "check_parity", "read_parity"]
