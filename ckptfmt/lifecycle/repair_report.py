"""What a repair found and did (``repair``): the objects it replaced and the damage nothing could mend."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptfmt.tools.verify import VerifyReport


@dataclass(frozen=True)
class Fix:
    """One object replaced (or, in a dry run, that would be)."""

    kind: str  # "marker", "chunk", "manifest", "commit-record", "signature", "history", "parity"
    key: str  # its key in the repaired repository
    source: str  # where the verified replacement was read, or "parity K+M" where it was rebuilt
    damage: str  # what was wrong with it
    checkpoints: tuple[str, ...] = ()


@dataclass(frozen=True)
class Unrepaired:
    """Damage no source had a good copy for."""

    kind: str  # "chunk", "checkpoint" (its commit record or manifest), "history" or "parity"
    checkpoint: str
    damage: str
    tried: str  # what each source had instead
    key: str | None = None
    tensors: tuple[str, ...] = ()


@dataclass
class RepairReport:
    """What a ``repair`` call found and did."""

    url: str
    sources: list[str]
    dry_run: bool
    checkpoints: list[str] = field(default_factory=list)
    fixed: list[Fix] = field(default_factory=list)
    unrepaired: list[Unrepaired] = field(default_factory=list)
    #: The repository verified after the repair (None: a dry run, or nothing could be read).
    verified: VerifyReport | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Nothing is left damaged: nothing was, or everything was repaired and then verified."""
        return not self.unrepaired and (self.dry_run or self.verified is None or self.verified.ok)


__all__ = ["Fix", "RepairReport", "Unrepaired"]
