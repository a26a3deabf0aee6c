"""ckptfmt: a verifiable, content-addressed checkpoint format for PyTorch.

    ckptfmt.save(state, "runs/exp1/step-100", step=100)
    state = ckptfmt.load("runs/exp1")            # the repository's latest checkpoint
    with ckptfmt.open("runs/exp1/step-100") as ckpt:
        w = ckpt.get_tensor("model/layers.0.attn.weight")
    ckptfmt.verify("s3://bucket/runs/exp1").ok
"""

from .asynchronous import async_save
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWarning,
    CollectiveError,
    CorruptDataError,
    InvalidNameError,
    ManifestError,
    StorageError,
    UnsupportedValueError,
    UnsupportedVersionError,
)
from .manifest import FORMAT_VERSION
from .manager import CheckpointManager, Tier
from .per_rank import PerRank, PerRankValues
from .reader import CheckpointReader, load, open, restore_rng
from .replicate import ReplicationReport, replicate
from .repository import Repository
from .retention import Retention
from .sharded import Shard, Sharded
from .step_timer import StepTimer
from .values import OpaqueObject
from .verify import VerifyReport, verify
from .writer import save

__version__ = "0.1.0"

__all__ = [
    "async_save",
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
    "ReplicationReport",
    "Repository",
    "Retention",
    "Shard",
    "Sharded",
    "StorageError",
    "Tier",
    "UnsupportedValueError",
    "UnsupportedVersionError",
    "VerifyReport",
    "load",
    "open",
    "replicate",
    "restore_rng",
    "save",
    "verify",
]
