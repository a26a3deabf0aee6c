"""Opening a save on its repository: the repository (created if missing) and the save lease that keeps
a garbage collector away (spec 11.6), the new name (checkpoints are immutable), and the parent with
the keys of its chunks. The save pipeline's coordinator and the DCP storage writer's both open here.
"""

from __future__ import annotations

import warnings
from typing import Any

from ckptfmt.errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CheckpointWarning
from ckptfmt.format import layout
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.format.limits import check_name
from ckptfmt.format.manifest import Manifest
from ckptfmt.repository.leases import Lease, hold_save_lease
from ckptfmt.repository.repository import Repository
from ckptfmt.saving.options import LATEST, SaveOptions


def open_for_save(repo_url: str, options: SaveOptions, *, max_hold_s: float | None = None
                  ) -> tuple[Repository, Lease]:
    """The repository (created if missing) and a save lease that keeps a garbage collector away
    (spec 11.6); the caller releases the lease."""
    repo = Repository.open(repo_url, options.storage_options, create=True, format_version=options.format_version,
                           features=options.marker_features)
    return repo, hold_save_lease(repo, max_hold_s=max_hold_s)


def refuse_taken_name(repo: Repository, name: str) -> None:
    """Checkpoints are immutable: a name with a commit record is taken."""
    if repo.storage.exists(layout.commit_key(name)):
        raise CheckpointExistsError(f"{repo.storage.describe(name)}: checkpoint already exists")


def resolve_parent(repo: Repository, parent: Any) -> tuple[str | None, set[str], Manifest | None]:
    """The parent's name, the keys of its chunks (committed, hence present and durable), and its manifest."""
    if parent is None:
        return None, set(), None
    if parent is LATEST:
        latest = repo.latest_record()  # through the commit index: a few requests whatever the repository holds
        if latest is None:
            return None, set(), None
        parent = latest.name
        try:
            manifest = repo.manifest(parent, latest)
        except CheckpointError as exc:  # a damaged latest checkpoint must not block new saves
            warnings.warn(f"not using {parent!r} as parent: {exc}", stacklevel=3, category=CheckpointWarning)
            return None, set(), None
    else:
        try:
            manifest = repo.manifest(check_name(parent))
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"parent checkpoint {parent!r} not found in {repo.url}") from None
    return parent, {stored_key(manifest.chunks, c) for c in manifest.chunks}, manifest
