"""Run analytics: what a run's checkpoints record about it, as Arrow tables (spec/ANALYTICS.md).

Built from commit records and manifests only (``compare`` reads tensor bytes
only where chunk hashes differ). Needs pyarrow, and matplotlib for the report
(``ckptfmt.analytics.report``): ``pip install ckptfmt[analytics]``; the rest of
ckptfmt needs neither.

Names load on first use (``__getattr__``): the tables, stragglers, goodput and
incremental exports read metadata only and never load torch; ``compare``,
``certify`` and ``health`` (which read tensors) load it when they are used.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

#: Each public name and the module that defines it.
_PUBLIC = {
    "certify": "ckptfmt.analytics.certify", "compare": "ckptfmt.analytics.compare",
    "Appended": "ckptfmt.analytics.dataset", "export_incremental": "ckptfmt.analytics.dataset",
    "goodput": "ckptfmt.analytics.goodput", "health": "ckptfmt.analytics.health",
    "Thresholds": "ckptfmt.analytics.stragglers", "episode_ranges": "ckptfmt.analytics.stragglers",
    "stragglers": "ckptfmt.analytics.stragglers",
    "TABLE_NAMES": "ckptfmt.analytics.tables", "export": "ckptfmt.analytics.tables",
    "tables": "ckptfmt.analytics.tables",
}

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from ckptfmt.analytics.certify import certify
    from ckptfmt.analytics.compare import compare
    from ckptfmt.analytics.dataset import Appended, export_incremental
    from ckptfmt.analytics.goodput import goodput
    from ckptfmt.analytics.health import health
    from ckptfmt.analytics.stragglers import Thresholds, episode_ranges, stragglers
    from ckptfmt.analytics.tables import TABLE_NAMES, export, tables


def __getattr__(name: str):
    """A public name's value on first use; cached in the module afterwards."""
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """This package, whose submodules are named as their functions (``tables``, ``certify``...): the import
    system binds a submodule to its package once it loads, and here the function is bound instead, so
    ``analytics.tables(...)`` stays the function whoever imported ``ckptfmt.analytics.tables`` first."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and _PUBLIC.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = ["TABLE_NAMES", "Appended", "Thresholds", "certify", "compare", "episode_ranges", "export",
           "export_incremental", "goodput", "health", "stragglers", "tables"]
