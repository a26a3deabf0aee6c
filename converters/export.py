"""Export a ckptfmt checkpoint to torch.save files, safetensors files, a DCP folder or a DeepSpeed folder.

``WRITERS`` maps each format to its writer, ``writer(reader, dest, **options)``,
as ``importer.SOURCES`` maps each source kind to its reader.
"""

from __future__ import annotations

import os

import ckptfmt
from ckptfmt.converters.deepspeed_export import to_deepspeed
from ckptfmt.converters.export_files import ExportResult, parse_size
from ckptfmt.converters.safetensors_export import to_safetensors
from ckptfmt.converters.torch_export import to_dcp, to_torch
from ckptfmt.errors import CheckpointError

#: format -> the writer of that format, and the options only it takes.
WRITERS = {
    "torch": (to_torch, ()),
    "safetensors": (to_safetensors, ("max_shard_size", "prefix", "provenance")),
    "dcp": (to_dcp, ()),
    "deepspeed": (to_deepspeed, ("world_size", "zero_stage", "ds_config")),
}
FORMATS = tuple(WRITERS)


def export_checkpoint(url: str | os.PathLike, dest: str | os.PathLike, *, format: str,
                      storage_options: dict | None = None, max_shard_size: int | str | None = None,
                      prefix: str | None = None, world_size: int | None = None, zero_stage: int | None = None,
                      ds_config: dict | None = None, provenance: bool = False) -> ExportResult:
    """Write checkpoint ``url`` to the local path ``dest`` as ``format`` (one of ``FORMATS``).

    safetensors only: ``prefix`` (e.g. ``"model/"``) exports only the keys under it, with
    the prefix stripped; ``max_shard_size`` (bytes, or ``"5GB"``, ``"100MB"``, ``"2GiB"``)
    writes ``dest`` as a folder of ``model-0000i-of-0000N.safetensors`` shards and
    ``model.safetensors.index.json``, as Hugging Face does (also when ``dest`` is an
    existing folder or ends with a path separator, with shards of at most 5GB). A checkpoint
    imported from safetensors keeps its source's ``__metadata__``, so an import then an
    export gives back the file byte for byte; ``provenance`` adds ``ckptfmt.source`` and
    ``ckptfmt.id`` (the checkpoint's URL and id) to the metadata.

    deepspeed only (a checkpoint imported from DeepSpeed ZeRO): ``world_size`` data-parallel
    ranks, ``zero_stage`` and the ``ds_config`` the files will be loaded with; see
    ``deepspeed_export.to_deepspeed``.
    """
    if format not in FORMATS:
        raise CheckpointError(f"unknown export format {format!r}: choose from {', '.join(FORMATS)}")
    given = {"max_shard_size": max_shard_size, "prefix": prefix, "world_size": world_size, "zero_stage": zero_stage,
             "ds_config": ds_config, "provenance": provenance}
    chosen = {name for name, value in given.items() if value is not None and value is not False}  # False: a default
    for other, (_, names) in WRITERS.items():
        if other != format and chosen.intersection(names):
            listed = ", ".join(names[:-1]) + f" and {names[-1]}"
            raise CheckpointError(f"{listed} apply to --format {other} only")
    writer, names = WRITERS[format]
    options = {name: given[name] for name in names}
    if options.get("max_shard_size") is not None:
        options["max_shard_size"] = parse_size(options["max_shard_size"])
    with ckptfmt.open(url, storage_options=storage_options) as reader:
        return writer(reader, os.fspath(dest), **options)
