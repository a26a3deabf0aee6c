"""A run's timing records, from its committed checkpoints' manifests and its removed ones' history objects.

Each save stored the run's timing since the save before it (spec 9.4: every rank's steps, system
samples, save phases and resumes); a removal kept it as a history object (spec 4.5). The
analyses that walk a run's timeline (``certify``, ``goodput``) read them all, oldest first.
"""

from __future__ import annotations

from ckptfmt.format.manifest import optional_fields_except
from ckptfmt.repository.history import read_histories, removed_histories
from ckptfmt.repository.repository import Repository

_SKIP = optional_fields_except("timing", "topology")


def saved_timings(repo: Repository) -> list[tuple[int, dict]]:
    """(created_ns, the ``timing`` map) of every save of the run, kept or removed, oldest first."""
    records = repo.commits()
    saves = [(record.created_ns, repo.manifest(record.name, record, skip=_SKIP).timing or {})
             for record in records]
    saves += [(history.created_ns, history.timing or {})
              for history in read_histories(repo, removed_histories(repo, records))]
    return sorted(saves, key=lambda save: save[0])
