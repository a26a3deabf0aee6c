"""Export to the files torch writes itself: a torch.save file, or a torch.distributed.checkpoint folder."""

from __future__ import annotations

import os
import shutil
import warnings

import torch

import ckptfmt
from ckptfmt.converters.export_files import ExportResult, restore_opaque, write_atomically
from ckptfmt.errors import CheckpointError


def to_torch(reader: ckptfmt.CheckpointReader, dest: str) -> ExportResult:
    """torch.save of the state, so torch.load(weights_only=True) gives back the same structure.

    Opaque objects (kept by an import) go back as they came: each is written as
    ``pickle.loads(<its pickle>)``, so ``torch.load(weights_only=False)`` rebuilds the
    original object where its class is importable (weights_only=True refuses them).
    """
    found: list[str] = []
    state = restore_opaque(reader.load_state(), found)
    write_atomically(dest, lambda tmp: torch.save(state, tmp))
    totals = reader.manifest.totals
    notes = []
    if found:
        notes.append(f"{len(found)} opaque object(s) written back as pickles ({', '.join(sorted(set(found))[:5])}"
                     f"{' ...' if len(set(found)) > 5 else ''}): load with torch.load(weights_only=False), "
                     "which runs them")
    return ExportResult(dest, totals.get("tensor_count", 0), os.path.getsize(dest), notes)


def to_dcp(reader: ckptfmt.CheckpointReader, dest: str) -> ExportResult:
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
    return ExportResult(dest, reader.manifest.totals.get("tensor_count", 0), size, notes, files)
