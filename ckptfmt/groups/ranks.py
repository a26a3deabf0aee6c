"""What the save pipeline needs of the ranks saving together, and the group of one.

The pipeline numbers the members of its group by their *position* (the order
of ``gather``'s list; the coordinator is position 0) and records each by its
*rank* (``rank_of``): in a process group the two are the same; a process saving
alone is the only member of its group, yet records the rank it has in its job
(``RANK`` under a launcher), so that its shards, RNG state and timing say which
process of the job wrote them.
"""

from __future__ import annotations

from typing import Any, Protocol

from ckptfmt.metadata.topology import rank_entry


class Ranks(Protocol):
    """The members of a save and their collectives (gather to the coordinator, broadcast from it)."""

    @property
    def position(self) -> int:
        """This process's position in the group (0: the coordinator)."""
        ...

    @property
    def count(self) -> int:
        """How many processes save together."""
        ...

    @property
    def rank(self) -> int:
        """The rank this process records."""
        ...

    @property
    def size(self) -> int:
        """The world size the checkpoint records."""
        ...

    @property
    def collective(self) -> bool:
        """Whether DTensors may be saved: their other shards are the other members'."""
        ...

    @property
    def backend(self) -> str | None:
        """The process group's backend, or None."""
        ...

    @property
    def is_coordinator(self) -> bool: ...

    def rank_of(self, position: int) -> int:
        """The rank recorded for the member at ``position``."""
        ...

    def topology_entry(self) -> dict:
        """This process's ``topology.ranks`` entry (spec 9.2)."""
        ...

    def join(self) -> None:
        """Wait until every member has called the save."""
        ...

    def gather(self, value: Any) -> list[Any] | None:
        """Every member's ``value`` on the coordinator, by position; None elsewhere."""
        ...

    def broadcast(self, value: Any = None) -> Any:
        """The coordinator's ``value`` on every member."""
        ...


class SoloRanks:
    """A group of one: this process saves alone, recording ``rank`` of a job of ``size`` processes.
    Its collectives hand values back as they are (nothing is pickled or sent)."""

    position = 0
    count = 1
    collective = False
    backend = None
    is_coordinator = True

    def __init__(self, rank: int = 0, size: int = 1):
        self.rank = rank
        self.size = size

    def rank_of(self, position: int) -> int:
        return self.rank

    def topology_entry(self) -> dict:
        return rank_entry(self.rank)

    def join(self) -> None:
        pass

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def broadcast(self, value: Any = None) -> Any:
        return value
