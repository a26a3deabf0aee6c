"""The manifest of a save: its tables, the state and user values, and every writing rank's record
(``records.rank_record``) in rank order, with the features its state requires (spec 13.2). The save
pipeline's coordinator and the DCP storage writer's ``finish`` both make theirs here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ckptfmt.format.features import refuse_unless_writable
from ckptfmt.format.manifest import Chunk, Manifest, TensorEntry, TensorTable
from ckptfmt.format.values import uses_per_rank
from ckptfmt.metadata.environment import merge_environments
from ckptfmt.saving.chunk_writer import checkpoint_totals
from ckptfmt.saving.options import SaveOptions


def manifest_for(name: str, options: SaveOptions, *, parent: str | None, chunks: list[Chunk],
                 tensors: list[TensorEntry], new_bytes: int, state: bytes, user: bytes, records: list[dict],
                 topology: dict, collective: bool, provenance: dict | None = None,
                 steps_only: Sequence[dict] = ()) -> Manifest:
    """The manifest of a save: its tables, and every writing rank's ``rank_record`` in rank order.

    ``collective``: the environments of the ranks are merged (``environment.ranks``, spec 9.3);
    ``provenance`` defaults to the options'; ``steps_only``: ``timing.ranks`` entries of ranks that
    wrote nothing (``steps_record``).
    """
    environments = [record["environment"] for record in records]
    return Manifest(
        name=name, step=options.step, created_ns=time.time_ns(), parent=parent, chunks=chunks,
        tensors=TensorTable(tensors), state=state, user=user,
        rng=options.rng if options.rng is not None else [record["rng"] for record in records],
        environment=merge_environments(environments) if collective else environments[0],
        topology=topology,
        timing={"ranks": sorted([record["timing"] for record in records] + list(steps_only),
                                key=lambda entry: entry["rank"]),
                "steps": list(options.step_times or [])},
        totals=checkpoint_totals(tensors, chunks, new_bytes),
        provenance=provenance if provenance is not None else options.provenance,
        version=options.format_version, requires=_state_features(state, options.format_version),
    )


def _state_features(state: bytes, version: tuple[int, int]) -> frozenset[str]:
    """The required features of the state's bytes (spec 13.2): per-rank values (1.1), if it holds any."""
    if not uses_per_rank(state):
        return frozenset()
    refuse_unless_writable("per-rank-values", version, "a value that differs between ranks")
    return frozenset({"per-rank-values"})
