"""The commit of a save (spec 11.1): the manifest, then the commit record that makes the checkpoint
exist, each durable before the next starts; a signature (spec 10.3) and parity (spec 5.6) go between.

Order of writes (the commit protocol): every chunk, then the manifest, then the
commit record, each durable before the next starts. A save that dies at any
point leaves earlier checkpoints untouched and its own invisible: readers only
see names with a commit record.

The other parts of a save that the save pipeline (saving/pipeline.py) and the DCP storage writer
(distributed/dcp.py) share have a module each: ``tensor_collector`` (the state's tensors),
``opening`` (repository, save lease, name, parent), ``records`` (each rank's record), ``manifests``
(the manifest), ``tables`` (its chunk and tensor tables). ``resolve_parent`` is named here too, for the
importers of its old place (tests/storage/test_catalog.py, bench/s3_scale.py).
"""

from __future__ import annotations

from ckptfmt.format import layout
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.signatures import SigningKey
from ckptfmt.repository.leases import Lease
from ckptfmt.repository.protecting import finish_protection, protect_checkpoint
from ckptfmt.repository.protection import parse_parity
from ckptfmt.repository.repository import CommitRecord, Repository
from ckptfmt.repository.signatures import write_signature
from ckptfmt.saving.opening import resolve_parent

__all__ = ["commit_manifest", "resolve_parent"]


def commit_manifest(repo: Repository, manifest: Manifest, lease: Lease, signer: SigningKey | None = None,
                    parity: str | None = None) -> None:
    """Write the manifest, then the commit record that makes the checkpoint exist, unless the save's
    lease has run out (a collector may have swept a chunk it reuses). With a ``signer``, the signature
    goes between the two (spec 10.3): a signed save is never seen committed and unsigned. With ``parity``
    ("K+M", spec 5.6), the parity of the manifest and every chunk goes before the commit record, which
    names it, and the record's copies after it."""
    data = manifest.to_bytes()
    checked = Manifest.from_bytes(data, repo.storage.describe(manifest.name))  # never commit what readers refuse
    digest = chunk_hash(data)
    key = layout.manifest_key(manifest.name, digest)
    repo.storage.write(key, data, durable=False)  # one fsync, the sync's, with its folder's
    repo.storage.sync([key])
    record = CommitRecord(
        name=manifest.name, manifest_hash=digest, manifest_size=len(data), step=manifest.step,
        created_ns=manifest.created_ns, parent=manifest.parent, totals=manifest.totals, version=manifest.version,
    )
    repo.declare(manifest.version, checked.requires)  # before the checkpoint exists: readers learn at once
    added = None
    if parity is not None:
        record, added = protect_checkpoint(repo, record, checked, *parse_parity(parity), commit=False)
    if signer is not None:
        write_signature(repo, record, signer)
    lease.check("writing the commit record")
    repo.create_commit(record)
    if added is not None and record.parity is not None:
        finish_protection(repo, added, record.parity)
