"""ckptfmt: a verifiable, content-addressed checkpoint format for PyTorch.

    ckptfmt.save(state, "runs/exp1/step-100", step=100)
    state = ckptfmt.load("runs/exp1")            # the repository's latest checkpoint
    with ckptfmt.open("runs/exp1/step-100") as ckpt:
        w = ckpt.get_tensor("model/layers.0.attn.weight")
    ckptfmt.verify("s3://bucket/runs/exp1").ok

``ckptfmt.dcp`` (the torch.distributed.checkpoint storage layer) and
``ckptfmt.analytics`` (needs pyarrow) load on first use, so ``import ckptfmt``
pulls in neither.
"""

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _installed_version

from ckptfmt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWarning,
    CollectiveError,
    CorruptDataError,
    InvalidNameError,
    ManifestError,
    StorageError,
    UnsafePathError,
    UnsupportedValueError,
    UnsupportedVersionError,
)
from ckptfmt.format.manifest import FORMAT_VERSION
from ckptfmt.format.per_rank import PerRank, PerRankValues
from ckptfmt.format.sharded import Shard, Sharded
from ckptfmt.format.signatures import SignatureError, SigningKey
from ckptfmt.format.values import OpaqueObject
from ckptfmt.lifecycle.manager import CheckpointManager, Tier
from ckptfmt.lifecycle.repair import RepairReport, repair
from ckptfmt.lifecycle.replicate import ReplicationReport, replicate
from ckptfmt.lifecycle.retention import Retention
from ckptfmt.lifecycle.signing import generate_key, sign
from ckptfmt.loading.reader import CheckpointReader, load, open, restore_rng
from ckptfmt.metadata.step_timer import StepTimer
from ckptfmt.repository.repository import Repository
from ckptfmt.saving.asynchronous import async_save
from ckptfmt.saving.save import save
from ckptfmt.tools.verify import VerifyReport, verify

try:
    __version__ = _installed_version("ckptfmt")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

#: Subpackages loaded on first attribute access (``ckptfmt.dcp.StorageWriter``).
_LAZY_SUBMODULES = frozenset({"analytics", "dcp"})


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY_SUBMODULES)


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
    "PerRank",
    "PerRankValues",
    "RepairReport",
    "ReplicationReport",
    "Repository",
    "Retention",
    "Shard",
    "Sharded",
    "SignatureError",
    "SigningKey",
    "StorageError",
    "Tier",
    "UnsafePathError",
    "UnsupportedValueError",
    "UnsupportedVersionError",
    "VerifyReport",
    "load",
    "open",
    "repair",
    "replicate",
    "restore_rng",
    "save",
    "sign",
    "verify",
]
