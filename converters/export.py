"""Export a ckptfmt checkpoint to torch.save files, safetensors files, a DCP folder or a DeepSpeed folder."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

import ckptfmt
from ckptfmt.format.dtypes import dtype_from_name
from ckptfmt.errors import CheckpointError

from ckptfmt.converters.safetensors_format import write_file

FORMATS = ("torch", "safetensors", "dcp", "deepspeed")


@dataclass
class ExportResult:
    """What an export wrote, and what it could not carry over."""

    path: str
    tensors: int
    bytes: int
    notes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def export_checkpoint(url: str | os.PathLike, dest: str | os.PathLike, *, format: str,
                      storage_options: dict | None = None, max_shard_size: int | str | None = None,
                      prefix: str | None = None, world_size: int | None = None, zero_stage: int | None = None,
                      ds_config: dict | None = None) -> ExportResult:
    """Write checkpoint ``url`` to the local path ``dest`` as ``format`` (one of ``FORMATS``).

    safetensors only: ``prefix`` (e.g. ``"model/"``) exports only the keys under it, with
    the prefix stripped; ``max_shard_size`` (bytes, or ``"5GB"``, ``"100MB"``, ``"2GiB"``)
    writes ``dest`` as a folder of ``model-0000i-of-0000N.safetensors`` shards and
    ``model.safetensors.index.json``, as Hugging Face does (also when ``dest`` is an
    existing folder or ends with a path separator, with shards of at most 5GB).

    deepspeed only (a checkpoint imported from DeepSpeed ZeRO): ``world_size`` data-parallel
    ranks, ``zero_stage`` and the ``ds_config`` the files will be loaded with; see
    ``deepspeed_export.to_deepspeed``.
    """
    if format not in FORMATS:
        raise CheckpointError(f"unknown export format {format!r}: choose from {', '.join(FORMATS)}")
    if format != "safetensors" and (max_shard_size is not None or prefix is not None):
        raise CheckpointError("max_shard_size and prefix apply to --format safetensors only")
    if format != "deepspeed" and (world_size is not None or zero_stage is not None or ds_config is not None):
        raise CheckpointError("world_size, zero_stage and ds_config apply to --format deepspeed only")
    dest = os.fspath(dest)
    shard_limit = parse_size(max_shard_size) if max_shard_size is not None else None
    with ckptfmt.open(url, storage_options=storage_options) as reader:
        if format == "torch":
            return _to_torch(reader, dest)
        if format == "dcp":
            return _to_dcp(reader, dest)
        if format == "deepspeed":
            from ckptfmt.converters.deepspeed_export import to_deepspeed  # imports this module: loaded on use

            return to_deepspeed(reader, dest, world_size=world_size, zero_stage=zero_stage, ds_config=ds_config)
        return _to_safetensors(reader, dest, max_shard_size=shard_limit, prefix=prefix)


def _to_torch(reader: ckptfmt.CheckpointReader, dest: str) -> ExportResult:
    """torch.save of the state, so torch.load(weights_only=True) gives back the same structure.

    Opaque objects (kept by an import) go back as they came: each is written as
    ``pickle.loads(<its pickle>)``, so ``torch.load(weights_only=False)`` rebuilds the
    original object where its class is importable (weights_only=True refuses them).
    """
    found: list[str] = []
    state = restore_opaque(reader.load_state(), found)
    write_atomically(dest, lambda tmp: torch.save(state, tmp))
    stats = reader.manifest.stats
    notes = []
    if found:
        notes.append(f"{len(found)} opaque object(s) written back as pickles ({', '.join(sorted(set(found))[:5])}"
                     f"{' ...' if len(set(found)) > 5 else ''}): load with torch.load(weights_only=False), "
                     "which runs them")
    return ExportResult(dest, stats.get("tensor_count", 0), os.path.getsize(dest), notes)


def _to_dcp(reader: ckptfmt.CheckpointReader, dest: str) -> ExportResult:
    """A folder that torch.distributed.checkpoint.load reads (written by DCP's own FileSystemWriter).

    Written from one process, so every tensor is whole (shards are assembled); DCP
    reshards on load. The folder appears only once complete (written beside, renamed).
    """
    from torch.distributed.checkpoint import FileSystemWriter, save

    if os.path.exists(dest):
        raise CheckpointError(f"{dest}: already exists; DCP export writes a new folder")
    found: list[str] = []
    state = restore_opaque(reader.load_state(), found)
    if not isinstance(state, dict):
        raise CheckpointError(f"{reader.url}: DCP needs a dict at the top of the state, not a {type(state).__name__}")
    tmp = f"{dest}.tmp-{os.getpid()}"
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            save(state, storage_writer=FileSystemWriter(tmp), no_dist=True)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(os.listdir(dest))
    notes = [f"{len(found)} opaque object(s) stored as DCP byte items"] if found else []
    size = sum(os.path.getsize(os.path.join(dest, f)) for f in files)
    return ExportResult(dest, reader.manifest.stats.get("tensor_count", 0), size, notes, files)


class _Repickled:
    """Pickles as ``pickle.loads(data)``: an opaque object's own pickle, unchanged."""

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return pickle.loads, (self.data,)


def restore_opaque(value, found: list[str]):
    """The state with each OpaqueObject replaced by its pickle (containers rebuilt only when needed)."""
    kind = type(value)
    if kind is ckptfmt.OpaqueObject:
        found.append(f"{value.module}.{value.qualname}")
        return _Repickled(value.pickle)
    if kind in (dict, OrderedDict):
        items = [(restore_opaque(k, found), restore_opaque(v, found)) for k, v in value.items()]
        if all(a is k and b is v for (a, b), (k, v) in zip(items, value.items())):
            return value
        return kind(items)
    if kind in (list, tuple, set, frozenset):
        items = [restore_opaque(v, found) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return kind(items)
    return value


#: Hugging Face's default shard size (save_pretrained's max_shard_size).
DEFAULT_SHARD_SIZE = 5_000_000_000
_SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
               "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like '5GB' (10**9), '2GiB' (2**30), '100MB' or '123456'."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).upper() if match else None
        if unit not in _SIZE_UNITS:
            raise CheckpointError(f"shard size {value!r}: expected bytes or a size like '5GB', '500MB', '2GiB'")
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    else:
        raise CheckpointError(f"shard size {value!r}: expected bytes or a size like '5GB'")
    if size <= 0:
        raise CheckpointError(f"shard size {value!r} must be positive")
    return size


def _to_safetensors(reader: ckptfmt.CheckpointReader, dest: str, *, max_shard_size: int | None = None,
                    prefix: str | None = None) -> ExportResult:
    """Flat tensors keyed by their ckptfmt keys (less ``prefix``), one file or HF-style shards.

    Tensors are read lazily and written one at a time, so memory holds at most one
    tensor; plain values do not fit safetensors and are noted.
    """
    from ckptfmt.converters.safetensors_format import TORCH_TO_SAFETENSORS, OutTensor

    notes: list[str] = []
    if prefix is not None:
        if not prefix or prefix == "/":
            raise CheckpointError("prefix must name a part of the state, e.g. 'model/'")
        if not prefix.endswith("/"):
            prefix += "/"  # keys are '/'-joined path segments: strip whole segments
    tensors: list[OutTensor] = []
    skipped = 0
    for key in reader.keys():
        if prefix is not None and not key.startswith(prefix):
            skipped += 1
            continue
        name = key[len(prefix):] if prefix is not None else key
        entry = reader.tensor_info(key)
        if entry.same_as is not None:
            notes.append(f"{key} is the same tensor as {reader.manifest.tensors[entry.same_as].key}; stored again")
        dtype = dtype_from_name(entry.dtype)
        if dtype not in TORCH_TO_SAFETENSORS:
            raise CheckpointError(f"{reader.url}: tensor {key!r} has dtype {entry.dtype}, which safetensors cannot hold")
        tensors.append(OutTensor(name, dtype, tuple(entry.shape), lambda key=key: reader.get_tensor(key)))
    if prefix is not None:
        if not tensors:
            raise CheckpointError(f"{reader.url}: no tensor key starts with {prefix!r}")
        if skipped:
            notes.append(f"{skipped} tensor(s) outside {prefix!r} are not exported")
    metadata = {"format": "pt", "ckptfmt.source": reader.url, "ckptfmt.id": reader.id}
    if reader.manifest.step is not None:
        metadata["ckptfmt.step"] = str(reader.manifest.step)
    if prefix is not None:
        metadata["ckptfmt.prefix"] = prefix
    notes.append("safetensors holds tensors only: the state's plain values (counters, hyper-parameters) are not exported")

    if max_shard_size is None and not (os.path.isdir(dest) or dest.endswith(("/", os.sep))):
        write_atomically(dest, lambda tmp: write_file(tmp, tensors, metadata))
        return ExportResult(dest, len(tensors), os.path.getsize(dest), notes, [dest])
    return safetensors_shards(dest, tensors, metadata, max_shard_size or DEFAULT_SHARD_SIZE, notes)


def safetensors_shards(folder: str, tensors: list, metadata: dict, limit: int, notes: list[str]) -> ExportResult:
    """Hugging Face layout: model-0000i-of-0000N.safetensors and model.safetensors.index.json."""
    from ckptfmt.converters.safetensors_format import INDEX_NAME

    shards: list[list] = [[]]
    size = 0
    for t in tensors:  # greedy, in key order; a tensor over the limit gets a shard of its own
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    count = len(shards)
    names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"{folder}: cannot create the output folder: {exc}") from None
    stale = sorted(n for n in os.listdir(folder) if re.fullmatch(r"model-\d+-of-\d+\.safetensors", n) and n not in names)
    if stale:
        notes.append(f"{folder}: older shard file(s) not in the new index are left as they were: {', '.join(stale)}")
    temps = [os.path.join(folder, f".{name}.tmp-{os.getpid()}") for name in names]
    try:
        for tmp, shard in zip(temps, shards):  # every shard first, then renames, the index last
            write_file(tmp, shard, metadata)
        for tmp, name in zip(temps, names):
            os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        for tmp in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    total = sum(t.nbytes for t in tensors)
    index = {"metadata": {"total_size": total},
             "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
    index_path = os.path.join(folder, INDEX_NAME)
    write_atomically(index_path, lambda tmp: _write_json(tmp, index))
    files = [os.path.join(folder, name) for name in names] + [index_path]
    return ExportResult(folder, len(tensors), sum(os.path.getsize(f) for f in files), notes, files)


def _write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_atomically(dest: str, write) -> None:
    """Write through a temp file and rename, so a failed export never leaves a half file."""
    tmp = f"{dest}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
