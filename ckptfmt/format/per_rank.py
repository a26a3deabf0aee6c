"""Values that differ per rank by design: a data loader's position, a rank's own RNG generator state.

A collective save keeps one copy of every plain value (the coordinator's) and
reports ranks whose copy differs. Wrap a value in ``PerRank`` to keep every
rank's instead; ``load`` returns it as ``PerRankValues`` (rank -> value), and
``load(into=)`` gives each rank a ``PerRank`` of its own value, which the next
save keeps per rank again.
"""

from __future__ import annotations

from typing import Any


class PerRank:
    """Marks a value in a state as this rank's own: ``state["loader"] = ckptfmt.PerRank(loader.state_dict())``."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"

    def __eq__(self, other: object) -> bool:
        """Equal to a ``PerRank`` of an equal value (unhashable, as its value usually is)."""
        return self.value == other.value if isinstance(other, PerRank) else NotImplemented


class PerRankValues(dict):
    """A saved ``PerRank`` value as loaded: rank -> that rank's value."""

    def __repr__(self) -> str:
        return f"PerRankValues({dict.__repr__(self)})"
