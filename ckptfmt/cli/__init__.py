"""The ``ckptfmt`` command: ls, show, verify, diff, export, import, and the ``tui``.

Errors print one line and exit non-zero (2; verify finding damage exits 1);
``--debug`` shows the traceback. Commands that need the converters import them
when run, so the core stays free of them.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from ..errors import CheckpointError
from . import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptfmt", description="Inspect, verify and convert ckptfmt checkpoints.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", help="list a repository's checkpoints")
    p.add_argument("repo", help="repository URL (local path, s3://, memory://)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=commands.ls)

    p = sub.add_parser("show", help="show a checkpoint's tensors and metadata")
    p.add_argument("checkpoint", help="checkpoint URL REPO/NAME, or a repository for its latest")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--limit", type=int, default=50, help="tensors to list (0: all)")
    p.set_defaults(run=commands.show)

    p = sub.add_parser("verify", help="check every byte of a checkpoint or a whole repository")
    p.add_argument("url", help="checkpoint or repository URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=commands.verify)

    p = sub.add_parser("diff", help="compare two checkpoints")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-measure", dest="measure", action="store_false", help="do not read changed tensors")
    p.add_argument("--limit", type=int, default=25, help="differing tensors to list (0: all)")
    p.set_defaults(run=commands.diff)

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
    p.add_argument("--world-size", type=int, metavar="N",
                   help="deepspeed: data-parallel ranks the ZeRO files are for (default: the source's)")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), help="deepspeed: ZeRO stage (default: the config's)")
    p.add_argument("--ds-config", metavar="JSON",
                   help="deepspeed: the DeepSpeed config file the run will load with (default: the recorded one)")
    p.set_defaults(run=commands.export)

    p = sub.add_parser("import", help="import a torch.save, safetensors, HF Trainer, Lightning, DCP or DeepSpeed checkpoint")
    p.add_argument("src", help="the file or folder to import (pickles are never run: unknown objects are kept opaque)")
    p.add_argument("dest", help="new checkpoint URL REPO/NAME")
    p.add_argument("--from", dest="kind", metavar="KIND", help="source format: deepspeed, hf-trainer, lightning, dcp, torch, safetensors (default: detected)")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: found in the source, if any)")
    p.add_argument("--tp-dim", action="append", metavar="REGEX=DIM",
                   help="deepspeed: tensor-parallel ranks split the parameters whose name REGEX matches on DIM "
                        "(or REGEX=replicated); repeatable, the first match wins (default: "
                        "universal_checkpoint_info, else inferred)")
    p.set_defaults(run=commands.import_)

    p = sub.add_parser("tui", help="browse, verify and compare checkpoints in a terminal UI")
    p.add_argument("targets", nargs="+", metavar="TARGET",
                   help="a repository or checkpoint URL; give two checkpoints to open their diff")
    p.set_defaults(run=commands.tui)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    errors = Console(stderr=True)
    try:
        return args.run(args, console) or 0
    except KeyboardInterrupt:
        errors.print("ckptfmt: interrupted")
        return 130
    except CheckpointError as exc:
        if args.debug:
            errors.print_exception()
        errors.print(f"ckptfmt: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except Exception as exc:  # a bug, or an environment problem we did not foresee
        if args.debug:
            errors.print_exception()
        errors.print(f"ckptfmt: error: {type(exc).__name__}: {exc} (rerun with --debug for details)",
                     markup=False, highlight=False, soft_wrap=True)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
