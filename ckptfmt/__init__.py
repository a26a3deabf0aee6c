"""ckptfmt: a verifiable, content-addressed checkpoint format for PyTorch.

    ckptfmt.save(state, "runs/exp1/step-100", step=100)
    state = ckptfmt.load("runs/exp1")            # the repository's latest checkpoint
    with ckptfmt.open("runs/exp1/step-100") as ckpt:
        w = ckpt.get_tensor("model/layers.0.attn.weight")
    ckptfmt.verify("s3://bucket/runs/exp1").ok

Every name loads on first use: ``import ckptfmt`` alone imports no torch (the
inspection commands never need it), ``ckptfmt.dcp`` (the torch.distributed.checkpoint
storage layer) and ``ckptfmt.analytics`` (needs pyarrow) neither.
"""

import importlib
from typing import TYPE_CHECKING

from ckptfmt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWarning,
    CollectiveError,
    CorruptDataError,
    InvalidNameError,
    ManifestError,
    StateMismatchError,
    StorageError,
    UnsafePathError,
    UnsupportedValueError,
    UnsupportedVersionError,
)

#: Each public name and the module that defines it: imported on first use (``__getattr__``), so that
#: ``import ckptfmt`` loads neither torch nor the save and load paths; the CLI's byte-level commands never
#: touch the names that need torch.
_PUBLIC = {
    "FORMAT_VERSION": "ckptfmt.format.version",
    "PerRank": "ckptfmt.format.per_rank", "PerRankValues": "ckptfmt.format.per_rank",
    "SignatureError": "ckptfmt.format.signatures", "SigningKey": "ckptfmt.format.signatures",
    "OpaqueObject": "ckptfmt.format.values",
    "CheckpointManager": "ckptfmt.lifecycle.manager", "Tier": "ckptfmt.lifecycle.manager",
    "ProtectReport": "ckptfmt.lifecycle.protect", "protect": "ckptfmt.lifecycle.protect",
    "RepairReport": "ckptfmt.lifecycle.repair", "repair": "ckptfmt.lifecycle.repair",
    "ReplicationReport": "ckptfmt.lifecycle.replicate", "replicate": "ckptfmt.lifecycle.replicate",
    "Retention": "ckptfmt.lifecycle.retention",
    "generate_key": "ckptfmt.lifecycle.signing", "sign": "ckptfmt.lifecycle.signing",
    "CheckpointReader": "ckptfmt.loading.reader", "load": "ckptfmt.loading.reader",
    "open": "ckptfmt.loading.reader", "restore_rng": "ckptfmt.loading.reader",
    "ResumeRecord": "ckptfmt.loading.resume_check", "record_resume": "ckptfmt.loading.resume_check",
    "StepTimer": "ckptfmt.metadata.step_timer",
    "Repository": "ckptfmt.repository.repository",
    "async_save": "ckptfmt.saving.asynchronous",
    "save": "ckptfmt.saving.save",
    "Shard": "ckptfmt.tensors.sharded", "Sharded": "ckptfmt.tensors.sharded",
    "VerifyReport": "ckptfmt.tools.verify", "verify": "ckptfmt.tools.verify",
}

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from ckptfmt.format.per_rank import PerRank, PerRankValues
    from ckptfmt.format.signatures import SignatureError, SigningKey
    from ckptfmt.format.values import OpaqueObject
    from ckptfmt.format.version import FORMAT_VERSION
    from ckptfmt.lifecycle.manager import CheckpointManager, Tier
    from ckptfmt.lifecycle.protect import ProtectReport, protect
    from ckptfmt.lifecycle.repair import RepairReport, repair
    from ckptfmt.lifecycle.replicate import ReplicationReport, replicate
    from ckptfmt.lifecycle.retention import Retention
    from ckptfmt.lifecycle.signing import generate_key, sign
    from ckptfmt.loading.reader import CheckpointReader, load, open, restore_rng
    from ckptfmt.loading.resume_check import ResumeRecord, record_resume
    from ckptfmt.metadata.step_timer import StepTimer
    from ckptfmt.repository.repository import Repository
    from ckptfmt.saving.asynchronous import async_save
    from ckptfmt.saving.save import save
    from ckptfmt.tensors.sharded import Shard, Sharded
    from ckptfmt.tools.verify import VerifyReport, verify


#: Subpackages loaded on first attribute access (``ckptfmt.dcp.StorageWriter``).
_LAZY_SUBMODULES = frozenset({"analytics", "dcp"})


def __getattr__(name: str):
    """A public name's value, or a lazy subpackage, on first use; cached in the module afterwards."""
    if name == "__version__":  # read from the installed package's metadata: a scan, only when asked for
        globals()[name] = _package_version()
        return globals()[name]
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _package_version() -> str:
    from importlib import metadata  # a scan of the installed packages: only for who asks for the version

    try:
        return metadata.version("ckptfmt")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | _LAZY_SUBMODULES)


__all__ = [
    "async_save",
    "generate_key",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "StepTimer",
    "CheckpointWarning",
    "CollectiveError",
    "CorruptDataError",
    "FORMAT_VERSION",
    "InvalidNameError",
    "ManifestError",
    "OpaqueObject",
    "ProtectReport",
    "PerRank",
    "PerRankValues",
    "RepairReport",
    "ReplicationReport",
    "Repository",
    "Retention",
    "ResumeRecord",
    "Shard",
    "Sharded",
    "SignatureError",
    "SigningKey",
    "StateMismatchError",
    "StorageError",
    "Tier",
    "UnsafePathError",
    "UnsupportedValueError",
    "UnsupportedVersionError",
    "VerifyReport",
    "load",
    "open",
    "protect",
    "repair",
    "record_resume",
    "replicate",
    "restore_rng",
    "save",
    "sign",
    "verify",
]
