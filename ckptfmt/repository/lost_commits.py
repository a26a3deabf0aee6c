"""Checkpoints that lost their commit record: a folder that still holds a manifest of a checkpoint the
repository shows was committed, but no ``COMMIT``.

Readers never see such a checkpoint (spec 4.3), so without this it silently vanishes. The evidence that
it was committed, strongest first:

- a packed record of the commit index names it: a compaction packs only records it read (spec 4.4);
- a committed checkpoint names it as its ``parent``: a save takes as parent a committed checkpoint;
- only an index entry names it: written just before the commit record, so a save killed in between
  leaves the same traces (``certain`` is then False, and a message says both).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptfmt.format import layout
from ckptfmt.format.limits import is_valid_name
from ckptfmt.repository.repository import Repository


@dataclass(frozen=True)
class LostCommit:
    """A checkpoint whose folder holds its manifest but whose commit record is missing."""

    name: str
    manifest_hash: str
    #: What shows it was committed: "the commit index records its commit", "checkpoint X names it as its
    #: parent", or "the commit index has an entry for it".
    evidence: str
    #: Whether the evidence proves a commit (else a save killed just before committing looks the same).
    certain: bool

    def message(self, repo_url: str) -> str:
        where = f"{repo_url}/{layout.commit_key(self.name)}"
        repair = f"`ckptfmt repair {repo_url} --from REPLICA` restores it from another copy"
        if self.certain:
            return f"{where}: missing, although {self.evidence}: the checkpoint is unreadable; {repair}"
        return (f"{where}: missing, although {self.evidence} and its folder holds its manifest: either its "
                f"commit record was lost ({repair}) or its save was killed just before committing "
                "(`ckptfmt gc` reclaims what it left)")


def lost_commits(repo: Repository, uncommitted: list[str], parents: dict[str, str | None]) -> list[LostCommit]:
    """The checkpoints among ``uncommitted`` (top-level entries without a commit record) that lost their
    commit record; ``parents``: each committed checkpoint's parent. Costs nothing more when every folder
    is committed; otherwise a listing of each such folder, and the index's packs once."""
    candidates = {name: _manifest_hashes(repo, name) for name in uncommitted if is_valid_name(name)}
    candidates = {name: hashes for name, hashes in candidates.items() if hashes}
    if not candidates:
        return []
    packed, entries = _indexed(repo)
    children = {parent: child for child, parent in sorted(parents.items()) if parent in candidates}
    found = []
    for name, hashes in sorted(candidates.items()):
        if hashes & packed.get(name, set()):
            found.append(LostCommit(name, min(hashes & packed[name]), "the commit index records its commit", True))
        elif name in children and len(hashes) == 1:
            found.append(LostCommit(name, next(iter(hashes)), f"checkpoint {children[name]!r} names it as its "
                                    "parent", True))
        elif hashes & entries.get(name, set()):
            found.append(LostCommit(name, min(hashes & entries[name]), "the commit index has an entry for it", False))
    return found


def _manifest_hashes(repo: Repository, name: str) -> set[str]:
    """The hashes of the manifests in checkpoint ``name``'s folder, by their file names."""
    return layout.manifest_digests(repo.storage.list(name))


def _indexed(repo: Repository) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Manifest hashes per name in the index's packs and in its entries (none without an index)."""
    packed: dict[str, set[str]] = {}
    entries: dict[str, set[str]] = {}
    listed = repo.index.listed() if repo.indexed else None
    if listed is not None:
        for entry in listed[0]:
            entries.setdefault(entry.name, set()).add(entry.manifest_hash)
        for record in listed[1]:
            packed.setdefault(record.name, set()).add(record.manifest_hash)
    return packed, entries
