"""Run analytics: what a run's checkpoints record about it, as Arrow tables (spec/ANALYTICS.md).

Built from commit records and manifests only, never tensor bytes. Needs
pyarrow (``pip install ckptfmt[analytics]``); the rest of ckptfmt does not.
"""

from .stragglers import Thresholds, stragglers
from .tables import TABLE_NAMES, export, tables

__all__ = ["TABLE_NAMES", "Thresholds", "export", "stragglers", "tables"]
