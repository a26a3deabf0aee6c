"""The ``ckptfmt export`` and ``ckptfmt import`` commands, registered through the ``ckptfmt.commands``
entry point so that the core CLI never imports the converters."""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from ckptfmt.errors import CheckpointError
from ckptfmt.tools.formatting import counted, human_bytes
from ckptfmt.tools.output import Output


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``export`` and ``import`` to the ``ckptfmt`` command's subparsers."""
    p = sub.add_parser("export", help="write a checkpoint in another format")
    p.add_argument("checkpoint")
    p.add_argument("dest", help="output file (or folder: sharded safetensors, dcp, deepspeed)")
    p.add_argument("--format", required=True, choices=("torch", "safetensors", "dcp", "deepspeed"))
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="safetensors: write DEST as a folder of Hugging Face shards "
                        "(model-0000i-of-0000N.safetensors + model.safetensors.index.json) of at most SIZE "
                        "(bytes, or 5GB, 500MB, 2GiB)")
    p.add_argument("--prefix", help="safetensors: export only the tensors under this key prefix, without it "
                                    "(e.g. model/ gives layers.0.weight)")
    p.add_argument("--provenance", action="store_true",
                   help="safetensors: add the checkpoint's URL and id to the metadata (ckptfmt.source, ckptfmt.id); "
                        "without it a checkpoint imported from safetensors is written back as it came")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="deepspeed: data-parallel ranks the ZeRO files are for (default: the source's)")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), help="deepspeed: ZeRO stage (default: the config's)")
    p.add_argument("--ds-config", metavar="JSON",
                   help="deepspeed: the DeepSpeed config file the run will load with (default: the recorded one)")
    p.set_defaults(run=export)

    p = sub.add_parser("import", help="import a torch.save, safetensors, HF Trainer, Lightning, DCP or DeepSpeed "
                                      "checkpoint")
    p.add_argument("src", help="the file or folder to import (pickles are never run: unknown objects are kept opaque)")
    p.add_argument("dest", help="new checkpoint URL REPO/NAME")
    p.add_argument("--from", dest="kind", metavar="KIND",
                   help="source format: deepspeed, hf-trainer, lightning, dcp, torch, safetensors (default: detected)")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: found in the source, if any)")
    p.add_argument("--tp-dim", action="append", metavar="REGEX=DIM",
                   help="deepspeed: tensor-parallel ranks split the parameters whose name REGEX matches on DIM "
                        "(or REGEX=replicated); repeatable, the first match wins (default: "
                        "universal_checkpoint_info, else inferred)")
    p.set_defaults(run=import_)


def export(args, console: Console) -> int:
    from ckptfmt.converters.export import export_checkpoint

    result = export_checkpoint(args.checkpoint, args.dest, format=args.format,
                               max_shard_size=args.max_shard_size, prefix=args.prefix, world_size=args.world_size,
                               zero_stage=args.zero_stage, ds_config=_json_file(args.ds_config),
                               provenance=args.provenance)
    out = Output(console)
    out.line(f"wrote {result.path} ({counted(result.tensors, 'tensor')}, {human_bytes(result.bytes)})")
    for note in result.notes:
        out.line(f"note: {note}")
    return 0


def _json_file(path: str | None) -> dict | None:
    """A JSON object from a file (e.g. a DeepSpeed config), or a CheckpointError naming the file."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _tp_dims(values: list[str] | None) -> dict | None:
    """``--tp-dim REGEX=DIM`` options as the DeepSpeed reader's tp_dims (DIM a dimension, or replicated)."""
    dims = {}
    for value in values or []:
        pattern, _, dim = value.rpartition("=")
        if not pattern or not (dim == "replicated" or dim.isdigit()):
            raise CheckpointError(f"--tp-dim {value!r}: expected REGEX=DIM, DIM a dimension or 'replicated'")
        dims[pattern] = None if dim == "replicated" else int(dim)
    return dims or None


def import_(args, console: Console) -> int:
    from ckptfmt.converters.importer import import_checkpoint

    tp_dims = _tp_dims(args.tp_dim)
    result = import_checkpoint(args.src, args.dest, kind=args.kind, step=args.step,
                               options={"tp_dims": tp_dims} if tp_dims else None)
    out = Output(console)
    out.line(f"imported {args.src} ({result.kind}) as {result.url}: {counted(result.tensors, 'tensor')}, "
             f"{counted(len(result.opaque), 'opaque object')}, {result.seconds:.2f} s")
    for key in result.opaque:
        out.line(f"opaque: {key}")
    for note in result.notes:
        out.line(f"note: {note}")
    return 0
