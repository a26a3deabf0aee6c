"""What a member's encoding of its state plans to store: each tensor's facts and the boxes of its bytes
it holds. The coordinator merges every member's into the checkpoint's tensor table (saving/planning.py,
spec 11.7); in a group they travel to it pickled, with the value tree."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class SourceBox:
    """One box of a tensor that this rank holds (spec 6.5): the index of the source holding its bytes,
    where the box starts in the global tensor, and the rank recorded as its owner (a ``Sharded`` shard's
    own; None: the rank that writes it)."""

    source: int
    offsets: tuple[int, ...]
    owner: int | None = None


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """A tensor of the state as one rank holds it (spec 6.4): key, dtype, global shape, kind, whether it
    requires grad, its boxes, and ``same_as``: the index of an earlier entry that is the same tensor."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    requires_grad: bool
    boxes: tuple[SourceBox, ...]
    same_as: int | None = None

    def alias(self, key: str, first: int) -> PlannedTensor:
        """This tensor under another key: the entry of a second reference to the same object."""
        return replace(self, key=key, same_as=first)
