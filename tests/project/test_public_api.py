"""The public API, as a list kept here: a change to it is a decision, not an accident of a refactor."""

from __future__ import annotations

import importlib
import subprocess
import sys

import ckptfmt

#: ``ckptfmt.__all__``.
TOP_LEVEL = [
    "CheckpointError", "CheckpointExistsError", "CheckpointManager", "CheckpointNotFoundError", "CheckpointReader",
    "CheckpointWarning", "CollectiveError", "CorruptDataError", "FORMAT_VERSION", "InvalidNameError",
    "ManifestError", "OpaqueObject", "PerRank", "PerRankValues", "ReplicationReport", "Repository", "Retention",
    "Shard", "Sharded", "StepTimer", "StorageError", "Tier", "UnsupportedValueError", "UnsupportedVersionError",
    "VerifyReport", "async_save", "load", "open", "replicate", "restore_rng", "save", "verify",
]
#: The ``__all__`` of the public subpackages: the DCP storage layer, analytics, converters and the TUI.
SUBPACKAGES = {
    "ckptfmt.dcp": ["StorageReader", "StorageWriter"],
    "ckptfmt.analytics": ["TABLE_NAMES", "Thresholds", "compare", "episode_ranges", "export", "stragglers", "tables"],
    "ckptfmt.converters": ["ExportResult", "ImportResult", "Imported", "export_checkpoint", "import_checkpoint"],
    "ckptfmt.tui": ["CheckpointApp", "create_app", "main"],
}
#: Dotted paths the docs use beyond those, each reached from ``import ckptfmt``.
DOTTED = ["ckptfmt.Repository.open", "ckptfmt.analytics.tables", "ckptfmt.analytics.stragglers",
          "ckptfmt.analytics.compare", "ckptfmt.dcp.StorageWriter", "ckptfmt.CheckpointManager.restore"]


def test_the_top_level_api_is_the_list():
    assert sorted(ckptfmt.__all__) == sorted(TOP_LEVEL)
    for name in TOP_LEVEL:
        assert getattr(ckptfmt, name) is not None


def test_the_subpackages_export_the_list():
    for module_name, names in SUBPACKAGES.items():
        module = importlib.import_module(module_name)
        assert sorted(module.__all__) == sorted(names), module_name
        for name in names:
            getattr(module, name)


def test_documented_dotted_paths_resolve_from_a_fresh_import():
    probe = ("import ckptfmt\n"
             f"for path in {DOTTED!r}:\n"
             "    value = ckptfmt\n"
             "    for part in path.split('.')[1:]:\n"
             "        value = getattr(value, part)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_save_and_load_are_functions_not_the_subpackages_that_hold_them():
    """ckptfmt/saving/ and ckptfmt/loading/ are named so that ckptfmt.save and ckptfmt.load stay functions."""
    import ckptfmt.loading.reader
    import ckptfmt.saving.save

    assert callable(ckptfmt.save) and ckptfmt.save.__module__ == "ckptfmt.saving.save"
    assert callable(ckptfmt.load) and ckptfmt.load.__module__ == "ckptfmt.loading.reader"
