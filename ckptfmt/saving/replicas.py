"""Replica divergence: ranks that hold the same replicated box (DDP's parameters, a DTensor replicated
on a mesh dimension) must hold the same bytes; a collective save compares them (spec 9.7).

Every rank fingerprints each of its sources (XXH3-128, ~25 GB/s on one core) in
the save's prepare step and sends the fingerprints with its plan; the
coordinator groups each shared box's holders by fingerprint. Copies that differ
mean a rank's memory was silently corrupted, or the ranks are out of sync: the
box is then written by a rank of the majority (ties go to the group holding the
lowest rank), and the divergence is recorded in the manifest, warned of or
raised (``SaveOptions.on_divergence``). No tensor byte travels between ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from ckptfmt.tensors.sources import TensorSource

#: Divergent boxes named in a warning or error message (the manifest records them all).
MAX_NAMED = 8


def fingerprints(sources: Sequence[TensorSource]) -> list[bytes]:
    """XXH3-128 of each source's bytes, in order."""
    return [xxhash.xxh3_128_digest(source.byte_view()) for source in sources]


@dataclass(frozen=True)
class Divergence:
    """A box whose holders do not all hold the same bytes."""

    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    #: The ranks holding the box, each group holding equal bytes, the largest first.
    groups: tuple[tuple[int, ...], ...]

    @property
    def majority(self) -> tuple[int, ...]:
        return self.groups[0]

    @property
    def outliers(self) -> tuple[int, ...]:
        return tuple(sorted(rank for group in self.groups[1:] for rank in group))

    def record(self) -> dict:
        """The manifest's entry (spec 9.7)."""
        return {"key": self.key, "offsets": list(self.offsets), "shape": list(self.shape),
                "ranks": sorted(rank for group in self.groups for rank in group),
                "majority": list(self.majority), "groups": [list(group) for group in self.groups]}

    def describe(self) -> str:
        box = "" if not any(self.offsets) else f" (box at {list(self.offsets)})"
        verb = "differs" if len(self.outliers) == 1 else "differ"
        return f"{self.key!r}{box}: {ranks_text(self.outliers)} {verb} from the majority ({ranks_text(self.majority)})"


def ranks_text(ranks: Sequence[int]) -> str:
    """'rank 2', 'ranks 0, 1, 3'."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def agreeing_groups(holders: Sequence[tuple[int, bytes]]) -> tuple[tuple[int, ...], ...]:
    """Holders (rank, fingerprint) grouped by equal fingerprints: the largest group first, ties to the
    group holding the lowest rank; each group's ranks in order."""
    by_print: dict[bytes, list[int]] = {}
    for rank, print_ in holders:
        by_print.setdefault(print_, []).append(rank)
    groups = sorted((tuple(sorted(ranks)) for ranks in by_print.values()), key=lambda group: (-len(group), group[0]))
    return tuple(groups)


def message(divergences: Sequence[Divergence], url: str) -> str:
    """One line naming the divergent boxes (the first ``MAX_NAMED``) and what was stored."""
    shown = "; ".join(d.describe() for d in divergences[:MAX_NAMED])
    more = f"; and {len(divergences) - MAX_NAMED} more" if len(divergences) > MAX_NAMED else ""
    return (f"{url}: the copies of {len(divergences)} replicated tensor(s) differ between ranks (silent data "
            f"corruption, or ranks out of sync): {shown}{more}")
