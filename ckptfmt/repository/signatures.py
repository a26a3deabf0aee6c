"""A repository's signature objects (spec 10.3): writing them, and judging a checkpoint's against the keys
a reader trusts.

``judge`` and ``check_signed`` are the reader's gate (``load``/``open``/``verify`` with ``trusted_keys``): a checkpoint
passes when a signature by a trusted key verifies, and is refused, named, when it is unsigned, signed only
by keys not trusted, or when a trusted key's signature does not verify (forged or damaged).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, StorageError, UnsupportedVersionError
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.signatures import (
    MAX_SIGNATURE_BYTES,
    Signature,
    SignatureError,
    SigningKey,
    entry_key_id,
    is_signature_entry,
    signature_key,
)
from ckptfmt.repository.repository import Repository


@dataclass(frozen=True)
class Found:
    """One signature object of a checkpoint: its key, and the object or what is wrong with it."""

    key: str
    signature: Signature | None
    damage: str | None = None
    #: The object requires a feature this ckptfmt lacks (a newer algorithm): unreadable, not damaged.
    newer: bool = False


def write_signature(repo: Repository, record: CommitRecord, key: SigningKey) -> tuple[str, bool]:
    """Sign ``record``'s checkpoint with ``key``: (the object's key, whether it was written); an existing
    signature by the same key that verifies is kept (signing again adds nothing)."""
    where = signature_key(record.name, key.key_id)
    for found in signatures(repo, record.name):
        if found.key == where and found.signature is not None and found.signature.verifies(record):
            return where, False
    repo.storage.write(where, key.sign(record).to_bytes(), durable=False)
    repo.storage.sync([where])
    return where, True


def signatures(repo: Repository, name: str) -> list[Found]:
    """The signature objects in checkpoint ``name``'s folder, each parsed (or its damage said)."""
    found = []
    for entry in repo.storage.list(name):
        if not is_signature_entry(entry):
            continue
        key = f"{name}/{entry}"
        where = repo.storage.describe(key)
        parse = functools.partial(Signature.from_bytes, where=where)
        try:
            found.append(_named(key, repo.storage.read_checked(key, max_size=MAX_SIGNATURE_BYTES, check=parse), where))
        except CheckpointNotFoundError:  # removed since the listing
            continue
        except StorageError:
            raise
        except UnsupportedVersionError as exc:
            found.append(Found(key, None, str(exc), newer=True))
        except CheckpointError as exc:
            found.append(Found(key, None, str(exc)))
    return found


def _named(key: str, signature: Signature, where: str) -> Found:
    """A parsed object, which counts as absent (damage) unless its name's key id is its ``key_id`` (spec 10.3)."""
    if entry_key_id(key) == signature.key_id:
        return Found(key, signature)
    return Found(key, None, f"{where}: named for key {entry_key_id(key)} but holds key {signature.key_id}'s "
                            "signature; it counts as absent")


def copy_signatures(source: Repository, target: Repository, record: CommitRecord) -> int:
    """Copy ``record``'s checkpoint's signature objects that ``target`` lacks or holds damaged (replication,
    repair); only objects that sign this very record under their own key travel. Returns how many."""
    theirs = {found.key: found for found in signatures(target, record.name)}
    copied = 0
    for found in signatures(source, record.name):
        if found.signature is None or not found.signature.verifies(record):
            continue
        there = theirs.get(found.key)
        if there is not None and there.signature is not None and there.signature.verifies(record):
            continue
        target.storage.write(found.key, found.signature.to_bytes(), durable=False)
        target.storage.sync([found.key])
        copied += 1
    return copied


def signature_problems(repo: Repository, record: CommitRecord) -> list[str]:
    """What is wrong with a checkpoint's signature objects by themselves (no key trusted): each must be
    intact and sign this very commit record under its own key; one that does not was damaged, or left
    behind by a checkpoint forged over it."""
    problems = []
    for found in signatures(repo, record.name):
        where = repo.storage.describe(found.key)
        if found.newer:  # a newer algorithm's: not damaged, only beyond this reader
            continue
        if found.signature is None:
            problems.append(f"{found.damage}")
        elif not found.signature.verifies(record):
            problems.append(f"{where}: the signature does not verify: the checkpoint or its signature changed "
                            "after it was signed (forged or damaged)")
    return problems


@dataclass(frozen=True)
class Verdict:
    """What a reader trusting some keys makes of a checkpoint's signatures."""

    #: The trusted key's signature that verifies; None: the checkpoint is refused.
    signature: Signature | None
    #: Why it is refused: "unsigned" (no signature by a trusted key) or "bad-signature" (one that does not
    #: verify); None when trusted.
    problem: str | None = None
    message: str = ""


def judge(repo: Repository, record: CommitRecord, trusted: dict[str, bytes]) -> Verdict:
    """The verdict on ``record``'s checkpoint for a reader trusting ``trusted`` (id -> raw public key)."""
    where = repo.storage.describe(record.name)
    found = signatures(repo, record.name)
    failed = []
    for entry in found:
        if entry.signature is None or entry.signature.key_id not in trusted:
            continue
        if entry.signature.verifies(record, trusted[entry.signature.key_id]):
            return Verdict(entry.signature)
        failed.append(entry.signature.key_id)
    keys = ", ".join(sorted(trusted))
    if failed:
        return Verdict(None, "bad-signature", f"{where}: the signature by trusted key {failed[0]} does not verify: "
                       "the checkpoint or its signature changed after it was signed (forged or damaged)")
    newer = [e for e in found if e.newer and entry_key_id(e.key) in trusted]
    if newer:
        return Verdict(None, "unsigned", f"{where}: cannot check the signature by trusted key "
                       f"{entry_key_id(newer[0].key)} ({newer[0].damage})")
    others = sorted({e.signature.key_id for e in found if e.signature is not None})
    if others:
        return Verdict(None, "unsigned", f"{where}: signed only by keys not trusted ({', '.join(others)}; "
                       f"trusted: {keys})")
    damaged = [e.damage for e in found if e.damage and not e.newer]  # a newer one by another key: not trusting
    if damaged:
        return Verdict(None, "bad-signature", f"{where}: no readable signature by a trusted key ({damaged[0]})")
    return Verdict(None, "unsigned", f"{where}: not signed by a trusted key (trusted: {keys}); `ckptfmt sign` "
                   "signs a checkpoint you vouch for")


def check_signed(repo: Repository, record: CommitRecord, trusted: dict[str, bytes]) -> Signature:
    """The signature by a ``trusted`` key that verifies ``record``; SignatureError naming the checkpoint
    otherwise (unsigned, signed by keys not trusted, or a signature that does not verify)."""
    verdict = judge(repo, record, trusted)
    if verdict.signature is None:
        raise SignatureError(f"{verdict.message}; refused")
    return verdict.signature
