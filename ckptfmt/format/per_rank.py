"""Values that differ per rank by design: a data loader's position, a rank's own RNG generator state.

A collective save keeps one copy of every plain value (the coordinator's) and
reports ranks whose copy differs. Wrap a value in ``PerRank`` to keep every
rank's instead; a single-process ``load`` returns it as ``PerRankValues``
(rank -> value), and a collective load gives each rank its own value.
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


class PerRankValues(dict):
    """A saved ``PerRank`` value as loaded: rank -> that rank's value."""

    def __repr__(self) -> str:
        return f"PerRankValues({dict.__repr__(self)})"
