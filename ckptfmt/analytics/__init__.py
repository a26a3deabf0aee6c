"""Run analytics: what a run's checkpoints record about it, as Arrow tables (spec/ANALYTICS.md).

Built from commit records and manifests only (``compare`` reads tensor bytes
only where chunk hashes differ). Needs pyarrow, and matplotlib for the report
(``ckptfmt.analytics.report``): ``pip install ckptfmt[analytics]``; the rest of
ckptfmt needs neither.
"""

from ckptfmt.analytics.certify import certify
from ckptfmt.analytics.compare import compare
from ckptfmt.analytics.dataset import Appended, export_incremental
from ckptfmt.analytics.goodput import goodput
from ckptfmt.analytics.health import health
from ckptfmt.analytics.stragglers import Thresholds, episode_ranges, stragglers
from ckptfmt.analytics.tables import TABLE_NAMES, export, tables

__all__ = ["TABLE_NAMES", "Appended", "Thresholds", "certify", "compare", "episode_ranges", "export",
           "export_incremental", "goodput", "health", "stragglers", "tables"]
