"""The public API, as a list kept here: a change to it is a decision, not an accident of a refactor."""

from __future__ import annotations

import importlib

import ckptfmt
from tests.support.documents import documented_paths, in_own_package

#: Attributes of the public names that the documents use (methods, module functions).
DOCUMENTED_ATTRIBUTES = {"ckptfmt.Repository.open"}
#: ``ckptfmt.__all__``.
TOP_LEVEL = [
    "CheckpointError", "CheckpointExistsError", "CheckpointManager", "CheckpointNotFoundError", "CheckpointReader",
    "CheckpointWarning", "CollectiveError", "CorruptDataError", "FORMAT_VERSION", "InvalidNameError", "ManifestError",
    "OpaqueObject", "PerRank", "PerRankValues", "ProtectReport", "RepairReport", "ReplicationReport", "Repository",
    "ResumeRecord", "Retention", "Shard", "Sharded", "SignatureError", "SigningKey", "StateMismatchError",
    "StepTimer", "StorageError", "Tier", "UnsafePathError", "UnsupportedValueError", "UnsupportedVersionError",
    "VerifyReport", "async_save", "generate_key", "load", "open", "protect", "record_resume", "repair", "replicate",
    "restore_rng", "save", "sign", "verify",
]
#: The ``__all__`` of the public subpackages: the DCP storage layer, analytics, converters and the TUI.
SUBPACKAGES = {
    "ckptfmt.dcp": ["StorageReader", "StorageWriter"],
    "ckptfmt.analytics": ["TABLE_NAMES", "Appended", "Thresholds", "certify", "compare", "episode_ranges", "export",
                          "export_incremental", "goodput", "health", "stragglers", "tables"],
    "ckptfmt.converters": ["ExportResult", "ImportResult", "Imported", "export_checkpoint", "import_checkpoint"],
    "ckptfmt.tui": ["CheckpointApp", "create_app", "main"],
}
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


def test_the_documents_use_only_the_public_api():
    """Every dotted name in README.md, docs/ and spec/ is the list's (test_first_use checks each resolves)."""
    public = {f"ckptfmt.{name}" for name in TOP_LEVEL} | {
        f"{module}.{name}" for module, names in SUBPACKAGES.items() for name in names} | set(SUBPACKAGES)
    documented = documented_paths()
    assert {path for path in documented - public - DOCUMENTED_ATTRIBUTES if not in_own_package(path)} == set()
    assert DOCUMENTED_ATTRIBUTES <= documented  # the list holds nothing the documents no longer use


def test_save_and_load_are_functions_not_the_subpackages_that_hold_them():
    """ckptfmt/saving/ and ckptfmt/loading/ are named so that ckptfmt.save and ckptfmt.load stay functions."""
    import ckptfmt.loading.reader
    import ckptfmt.saving.save

    assert callable(ckptfmt.save) and ckptfmt.save.__module__ == "ckptfmt.saving.save"
    assert callable(ckptfmt.load) and ckptfmt.load.__module__ == "ckptfmt.loading.reader"
