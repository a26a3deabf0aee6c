"""The analytics tables written out: a file per table, Parquet or CSV (``ckptfmt analytics export``).
The run-partitioned dataset that grows with a run is ``dataset.py``'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq


def export(built: Mapping[str, pa.Table], out: str | os.PathLike, fmt: str = "parquet") -> list[Path]:
    """Write each table as ``OUT/<name>.parquet`` or ``.csv`` (lists and bytes become text in CSV)."""
    if fmt not in ("parquet", "csv"):
        raise ValueError(f"format must be parquet or csv, not {fmt!r}")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, table in built.items():
        path = folder / f"{name}.{fmt}"
        if fmt == "parquet":
            pq.write_table(table, path)
        else:
            pa_csv.write_csv(_flat_for_csv(table), path)
        paths.append(path)
    return paths



def _flat_for_csv(table: pa.Table) -> pa.Table:
    """CSV holds no lists or bytes: lists become JSON text, bytes hex."""
    for index, field in enumerate(table.schema):
        column = table.column(index)
        if pa.types.is_list(field.type):
            text = pa.array([None if v is None else json.dumps(v) for v in column.to_pylist()], pa.string())
        elif pa.types.is_binary(field.type) or pa.types.is_fixed_size_binary(field.type):
            text = pa.array([None if v is None else v.hex() for v in column.to_pylist()], pa.string())
        elif pa.types.is_dictionary(field.type):
            text = column.cast(pa.string())
        else:
            continue
        table = table.set_column(index, field.name, text)
    return table

