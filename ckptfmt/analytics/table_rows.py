"""The analytics tables built as rows, a manifest at a time (``table_columns.RowBuilder``): checkpoints,
saves, resumes, tensors and tensor statistics (spec/ANALYTICS.md).
"""

from __future__ import annotations

import pyarrow as pa

from ckptfmt.analytics.table_columns import TIME, RowBuilder, Saved, as_list, as_map, rank_records
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.shards import chunk_rows
from ckptfmt.format.tensor_stats import FLOAT_FIELDS
from ckptfmt.repository.repository import CommitRecord


class Checkpoints(RowBuilder):
    """One row per checkpoint."""

    fields = (("run", pa.string()), ("name", pa.string()), ("step", pa.int64()), ("created", TIME),
              ("parent", pa.string()), ("world_size", pa.int64()), ("tensor_count", pa.int64()),
              ("tensor_bytes", pa.int64()), ("chunk_count", pa.int64()), ("stored_bytes", pa.int64()),
              ("new_bytes", pa.int64()), ("manifest_bytes", pa.int64()), ("save_s", pa.float64()),
              ("format_version", pa.string()))

    def add(self, run: str, record: CommitRecord, manifest: Manifest, where: str) -> None:
        self.origin(where)
        counts = as_map(manifest.totals, where, "stats")
        recorded = [r.get("total_s") for r in rank_records(manifest, where)]
        totals = [t for t in recorded if isinstance(t, (int, float)) and not isinstance(t, bool)]
        topology = as_map(manifest.topology, where, "topology")
        row = {
            "run": run, "name": record.name, "step": record.step, "created": record.created_ns,
            "parent": record.parent, "world_size": topology.get("world_size"),
            **{k: counts.get(k) for k in ("tensor_count", "tensor_bytes", "chunk_count", "stored_bytes", "new_bytes")},
            "manifest_bytes": record.manifest_size, "save_s": max(totals) if totals else None,
            "format_version": ".".join(map(str, manifest.version)),
        }
        for name, column in self.columns.items():
            column.append(row[name])
        self.rows += 1


class Saves(RowBuilder):
    """One row per save, rank and save phase, removed checkpoints' saves included."""

    reads_history = True

    fields = (("run", pa.string()), ("name", pa.string()), ("step", pa.int64()), ("rank", pa.int64()),
              ("host", pa.string()), ("phase", pa.string()), ("start", TIME), ("duration_s", pa.float64()),
              ("rank_total_s", pa.float64()))

    def add(self, run: str, record: Saved, manifest: Saved, where: str) -> None:
        self.origin(where)
        columns = self.columns
        for index, rank_record in enumerate(rank_records(manifest, where)):
            phases = [as_map(phase, where, f"timing.ranks[{index}].phases[{position}]") for position, phase
                      in enumerate(as_list(rank_record.get("phases"), where, f"timing.ranks[{index}].phases"))]
            count = len(phases)
            for name, value in (("run", run), ("name", record.name), ("step", record.step),
                                ("rank", rank_record.get("rank")), ("host", rank_record.get("host")),
                                ("rank_total_s", rank_record.get("total_s"))):
                columns[name].extend([value] * count)
            for name, field in (("phase", "name"), ("start", "start_ns"), ("duration_s", "duration_s")):
                columns[name].extend([phase.get(field) for phase in phases])
            self.rows += count


class Resumes(RowBuilder):
    """One row per resume, rank and part of the state compared (spec 9.4 ``resumes``), removed
    checkpoints' records included; a resume that compared no part has one row with no part."""

    reads_history = True

    fields = (("run", pa.string()), ("checkpoint", pa.string()), ("rank", pa.int64()), ("from_name", pa.string()),
              ("from_step", pa.int64()), ("from_manifest", pa.string()), ("from_repository", pa.string()),
              ("resumed", TIME), ("world_size_then", pa.int64()), ("world_size_now", pa.int64()),
              ("part", pa.string()), ("verdict", pa.string()), ("stored", pa.int64()), ("missing", pa.int64()),
              ("different", pa.int64()), ("keys", pa.list_(pa.string())), ("feeds", pa.string()))

    def add(self, run: str, record: Saved, manifest: Saved, where: str) -> None:
        self.origin(where)
        for index, rank_record in enumerate(rank_records(manifest, where)):
            what = f"timing.ranks[{index}].resumes"
            for position, resume in enumerate(as_list(rank_record.get("resumes"), where, what)):
                resume = as_map(resume, where, f"{what}[{position}]")
                source = as_map(resume.get("from"), where, f"{what}[{position}].from")
                sizes = resume.get("world_size")
                then, now = sizes if isinstance(sizes, list) and len(sizes) == 2 else (None, None)
                parts = [as_map(part, where, f"{what}[{position}].parts") for part
                         in as_list(resume.get("parts"), where, f"{what}[{position}].parts")] or [{}]
                common = {"run": run, "checkpoint": record.name, "rank": resume.get("rank"),
                          "from_name": source.get("name"), "from_step": source.get("step"),
                          "from_manifest": source.get("manifest"), "from_repository": source.get("repository"),
                          "resumed": resume.get("resumed_ns"), "world_size_then": then, "world_size_now": now}
                for part in parts:
                    for name, value in common.items():
                        self.columns[name].append(value)
                    for name in ("part", "verdict", "stored", "missing", "different", "keys", "feeds"):
                        self.columns[name].append(part.get(name))
                    self.rows += 1


class Tensors(RowBuilder):
    """One row per checkpoint and tensor: dtype, shape, bytes, shards, and the chunks holding it."""

    fields = (("run", pa.string()), ("name", pa.string()), ("step", pa.int64()), ("key", pa.string()),
              ("dtype", pa.string()), ("shape", pa.list_(pa.int64())), ("nbytes", pa.int64()),
              ("kind", pa.string()), ("shards", pa.int64()), ("same_as", pa.string()),
              ("chunks", pa.list_(pa.string())))

    def add(self, run: str, record: CommitRecord, manifest: Manifest, where: str) -> None:
        self.origin(where)
        chunks = manifest.chunks
        columns = self.columns
        for tensor in manifest.tensors:
            hashes = list(dict.fromkeys(chunks[row].hash for row in chunk_rows(tensor.shards)))
            same_as = None if tensor.same_as is None else manifest.tensors[tensor.same_as].key
            for name, value in (("run", run), ("name", record.name), ("step", record.step), ("key", tensor.key),
                                ("dtype", tensor.dtype), ("shape", list(tensor.shape)), ("nbytes", tensor.nbytes),
                                ("kind", tensor.kind), ("shards", len(tensor.shards)), ("same_as", same_as),
                                ("chunks", hashes)):
                columns[name].append(value)
            self.rows += 1


_COUNTS = frozenset({"count", "nan", "posinf", "neginf", "zeros"})


class TensorStatsTable(RowBuilder):
    """One row per checkpoint and tensor with recorded statistics (spec 6.10, format 1.4); a tensor that
    is the same object as an earlier one (``same_as``) is left out, as its statistics are that one's."""

    fields = (("run", pa.string()), ("name", pa.string()), ("step", pa.int64()), ("key", pa.string()),
              ("dtype", pa.string()), *((field, pa.int64() if field in _COUNTS else pa.float64())
                                        for field in FLOAT_FIELDS))

    def add(self, run: str, record: CommitRecord, manifest: Manifest, where: str) -> None:
        self.origin(where)
        columns = self.columns
        for tensor in manifest.tensors:
            if tensor.stats is None or tensor.same_as is not None:
                continue
            for name, value in (("run", run), ("name", record.name), ("step", record.step), ("key", tensor.key),
                                ("dtype", tensor.dtype)):
                columns[name].append(value)
            for field in FLOAT_FIELDS:
                columns[field].append(tensor.stats.get(field))
            self.rows += 1
