"""The tables of shares of a run's checkpoints, built by several processes (``table_build``), joined
into those one process builds from them all: the same rows, columns and order, one dictionary per
text column, each distinct environment once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ckptfmt.analytics.table_columns import TABLE_NAMES
from ckptfmt.analytics.table_timing import Steps, System


def joined(built: Sequence[Mapping[str, pa.Table]]) -> dict[str, pa.Table]:
    """The tables of shares of checkpoints (in order) as one process builds them all: rows in order,
    every column met in any share (null where a share had none) in the table's order, each distinct
    environment once, and one dictionary per text column."""
    result = {}
    for name in TABLE_NAMES:
        pieces = [tables[name] for tables in built]
        met = [column for piece in pieces for column in piece.column_names]
        order = Steps.ordered(met) if name == "steps" else System.ordered(met) if name == "system" \
            else list(dict.fromkeys(met))
        types = {field.name: field.type for piece in reversed(pieces) for field in piece.schema}
        pieces = [pa.table({column: piece[column] if column in piece.column_names
                            else pa.nulls(piece.num_rows, types[column]) for column in order}) for piece in pieces]
        if name == "environments":
            pieces = _first_of_each_environment(pieces)
        table = pa.concat_tables(pieces)
        for index, field in enumerate(table.schema):
            if pa.types.is_dictionary(field.type):
                table = table.set_column(index, field, _one_dictionary(table.column(index)))
        result[name] = table
    return result


def _one_dictionary(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A dictionary column's chunks over one dictionary: the first chunk's, then the words later chunks add.
    A chunk whose dictionary starts that one keeps its indices (shares seeded with the same words mostly
    have the same dictionary: ``table_build.seed_words``); others' are mapped (``unify_dictionaries``
    maps every chunk's, a copy of each share's indices, and touches every page of the children's)."""
    if column.num_chunks <= 1:
        return column
    ids: dict[Any, int] = {}
    mappings: list[tuple[pa.Array, np.ndarray | None]] = []  # each distinct dictionary, and its ids (None: the same)
    chunks = []
    for chunk in column.chunks:
        dictionary = chunk.dictionary
        mapping = next((m for d, m in mappings if d is dictionary or d.equals(dictionary)), False)
        if mapping is False:
            values = dictionary.to_pylist()
            mapped = np.fromiter((ids.setdefault(value, len(ids)) for value in values), np.int32, len(values))
            mapping = None if np.array_equal(mapped, np.arange(len(values))) else mapped
            mappings.append((dictionary, mapping))
        chunks.append(chunk.indices if mapping is None else pc.take(pa.array(mapping, pa.int32()), chunk.indices))
    words = pa.array(list(ids), column.type.value_type)
    # Not checked again (safe=False): checking reads every index, every page of a child's tables.
    return pa.chunked_array([pa.DictionaryArray.from_arrays(indices.cast(column.type.index_type), words, safe=False)
                             for indices in chunks], column.type)


def _first_of_each_environment(pieces: list[pa.Table]) -> list[pa.Table]:
    """``environments`` rows of shares, an environment's rows kept from the first share that has it."""
    seen: set[int] = set()
    kept = []
    for piece in pieces:
        if seen:
            piece = piece.filter(pc.invert(pc.is_in(piece["environment_id"], pa.array(sorted(seen), pa.int64()))))
        kept.append(piece)
        seen.update(piece["environment_id"].unique().to_pylist())
    return kept

