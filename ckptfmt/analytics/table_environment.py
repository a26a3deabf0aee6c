"""The analytics tables of the environments a run's ranks ran in (spec 9.2): ``environment`` (a row per
checkpoint and rank, naming its environment by id) and ``environments`` (each distinct environment's
dotted fields once); and an environment's id, the same in every run (spec/ANALYTICS.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from ckptfmt.analytics.table_columns import Words, as_list, as_map
from ckptfmt.errors import ManifestError
from ckptfmt.format.manifest import Manifest
from ckptfmt.repository.repository import CommitRecord

#: Flattened environment values longer than this are cut (a hostile manifest's megabyte string).
MAX_VALUE_CHARS = 4096


class Environment:
    """One row per checkpoint and rank: the environment it ran in, as ``environment_id``, whose fields
    are rows of ``environments`` (``EnvironmentFields``). A run's ranks and checkpoints mostly share a
    few environments (spec 9.2): each distinct one is stored once (a thousand checkpoints of 64 ranks
    gave 11 million field rows when every rank's fields were rows of their own)."""

    fields = (("run", pa.string()), ("name", pa.string()), ("step", pa.int64()), ("rank", pa.int64()),
              ("environment_id", pa.int64()))
    reads_history = False

    def __init__(self):
        self.words = Words()  # every run and name, and every environment's fields and values
        self.parts: dict[str, list[np.ndarray]] = {name: [] for name in [*dict(self.fields), "no_step"]}
        #: Each distinct environment's field and value ids (word ids), by environment id.
        self.environments: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.last: tuple[dict, int] | None = None  # the last environment met, and its id

    def add(self, run: str, record: CommitRecord, manifest: Manifest, where: str) -> None:
        environment = as_map(manifest.environment, where, "environment")
        groups = [environment] + [as_map(e, where, "environment.others[]")
                                  for e in as_list(environment.get("others"), where, "environment.others")]
        for group in groups:
            ranks = group.get("ranks", [0])
            if not isinstance(ranks, list) or not all(type(r) is int for r in ranks):
                raise ManifestError(f"{where}: environment.ranks is not an array of ints")
            identity = self._id({k: v for k, v in group.items() if k not in ("ranks", "others")})
            count = len(ranks)
            self._extend(run=np.full(count, self.words.id(run), np.int32),
                         name=np.full(count, self.words.id(record.name), np.int32),
                         step=np.full(count, record.step or 0, np.int64),
                         no_step=np.full(count, record.step is None),
                         rank=np.array(ranks, dtype=np.int64), environment_id=np.full(count, identity, np.int64))

    def flush(self) -> None:
        """Rows are arrays already."""

    def _id(self, environment: dict) -> int:
        """The id of an environment (``environment_id``); a run's checkpoints mostly repeat the last one."""
        if self.last is not None and self.last[0] == environment:
            return self.last[1]
        flat = sorted(flatten_fields(environment))
        identity = environment_id(flat)
        if identity not in self.environments:
            self.environments[identity] = (np.array([self.words.id(f) for f, _ in flat], dtype=np.int32),
                                           np.array([self.words.id(v) for _, v in flat], dtype=np.int32))
        self.last = (environment, identity)
        return identity

    def _extend(self, **parts: np.ndarray) -> None:
        for name, part in parts.items():
            self.parts[name].append(part)

    def table(self) -> pa.Table:
        parts = {name: np.concatenate(p) if p else np.array([], np.int32) for name, p in self.parts.items()}
        arrays = []
        for name, type_ in self.fields:
            part = parts[name]
            if type_ == pa.string():
                arrays.append(self.words.encode(part))
            elif name == "step":
                arrays.append(pa.array(part, pa.int64(), mask=parts["no_step"].astype(bool)))
            else:
                arrays.append(pa.array(part, type_))
        return pa.Table.from_arrays(arrays, names=[name for name, _ in self.fields])


class EnvironmentFields:
    """The ``environments`` table: one row per distinct environment and dotted field, its value as text
    (the environments ``Environment`` met, by its ``environment_id``)."""

    fields = (("environment_id", pa.int64()), ("field", pa.string()), ("value", pa.string()))
    reads_history = False

    def __init__(self, environment: Environment):
        self.environment = environment

    def add(self, run: str, record: CommitRecord, manifest: Manifest, where: str) -> None:
        """``Environment`` reads the manifests."""

    def flush(self) -> None:
        """Rows are arrays already."""

    def table(self) -> pa.Table:
        found = self.environment.environments
        ids = np.repeat(np.fromiter(found, np.int64, len(found)), [len(fields) for fields, _ in found.values()])
        fields = np.concatenate([f for f, _ in found.values()]) if found else np.array([], np.int32)
        values = np.concatenate([v for _, v in found.values()]) if found else np.array([], np.int32)
        words = self.environment.words
        return pa.Table.from_arrays([pa.array(ids, pa.int64()), words.encode(fields), words.encode(values)],
                                    names=[name for name, _ in self.fields])


def environment_id(fields: list[tuple[str, str]]) -> int:
    """An environment's id, the same in every call and run: BLAKE2b with an 8-byte digest over the JSON
    text of its sorted ``[field, value]`` pairs, as a big-endian signed int64 (spec/ANALYTICS.md)."""
    text = json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big", signed=True)


def flatten_fields(value: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted field, value as text) for every leaf of a metadata map; lists are indexed (gpus.0.name)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten_fields(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from flatten_fields(item, f"{prefix}.{index}" if prefix else str(index))
    else:
        yield prefix, _text(value)


def _text(value: Any) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, bytes):
        text = value.hex()
    else:
        text = json.dumps(value)
    return text[:MAX_VALUE_CHARS]
