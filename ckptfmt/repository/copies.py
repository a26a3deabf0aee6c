"""Reading and writing a node-scoped checkpoint's copy records (spec 9.8, ``format.copies``)."""

from __future__ import annotations

import functools
import time
import warnings

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWarning, StorageError
from ckptfmt.format.copies import MAX_COPY_BYTES, CopyRecord, copy_entry_host, copy_key
from ckptfmt.repository.repository import Repository


def copy_records(repo: Repository, name: str, manifest_hash: str,
                 damaged: list[str] | None = None) -> dict[str, CopyRecord]:
    """Host -> the copy record of that node's chunks held here for checkpoint ``name`` (the one whose
    manifest hash is ``manifest_hash``); a damaged record, or one of another manifest, counts for
    nothing (what is wrong with a damaged one goes to ``damaged``, else to a warning)."""
    found: dict[str, CopyRecord] = {}
    for entry in repo.storage.list(name):
        host = copy_entry_host(entry)
        if host is None:
            continue
        key = f"{name}/{entry}"
        where = repo.storage.describe(key)
        try:
            record = repo.storage.read_checked(key, max_size=MAX_COPY_BYTES,
                                               check=functools.partial(CopyRecord.from_bytes, where=where))
        except CheckpointNotFoundError:  # removed since the listing
            continue
        except StorageError:
            raise
        except CheckpointError as exc:
            if damaged is None:
                warnings.warn(f"copy record ignored: {exc}", CheckpointWarning, stacklevel=2)
            else:
                damaged.append(f"copy record ignored: {exc}")
            continue
        if record.host == host and record.manifest_hash == manifest_hash:
            found[host] = record
    return found


def write_copy_record(repo: Repository, name: str, host: str, manifest_hash: str, chunks: int,
                      size: int) -> None:
    """Say, durably, that ``repo`` holds node ``host``'s chunks of ``name``: once they are verified here."""
    key = copy_key(name, host)
    repo.storage.write(key, CopyRecord(host, manifest_hash, time.time_ns(), chunks, size).to_bytes(repo.format_version))
