"""Import other checkpoint formats into ckptfmt: the framework every source kind plugs into.

A source kind is a module with ``detect(path) -> bool`` and ``read(path) -> Imported``.
``import_checkpoint`` picks the kind (``kind=`` or the first whose ``detect`` says yes),
reads the source into an ``Imported`` (its value tree, step, RNG states, versions, what
was kept opaque), then ``ckptfmt.save``s it with a ``provenance`` record (spec 9.6).
A kind may also provide ``read_deferred(path) -> Imported`` that returns with checks of
the source still running (``Imported.pending``, e.g. the torch reader's CRC-32s):
``import_checkpoint`` then saves while they run and waits for them just before the
commit (``ckptfmt.save(before_commit=)``). Everything else is read before the save, and
the save commits last, so a source that is unknown, truncated, inconsistent or damaged
raises ``CheckpointError`` and leaves no checkpoint.
"""

from __future__ import annotations

import importlib
import inspect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import numpy as np
import torch

import ckptfmt
from ckptfmt.errors import CheckpointError, CheckpointNotFoundError
from ckptfmt.metadata.timing import PhaseTimer
from ckptfmt.repository.repository import split_checkpoint_url


class PendingCheck(Protocol):
    """Checks of a source that a reader left running in the background."""

    def wait(self) -> None:
        """Block until they are done; raise CheckpointError naming what is damaged."""

    def cancel(self) -> None:
        """Give up on them: the import failed for another reason."""


@dataclass
class Imported:
    """What a reader found in a source checkpoint, ready for ckptfmt.save."""

    state: Any                       # value tree for ckptfmt.save (tensors may be mmap-backed views)
    kind: str                        # "torch", "safetensors", ...
    step: int | None = None
    metadata: dict = field(default_factory=dict)   # user metadata for the checkpoint
    rng: list[dict] | None = None    # RNG entries in ckptfmt's format (ckptfmt/rng.py), if the source had them
    versions: dict = field(default_factory=dict)   # tool versions found in the files
    opaque: list[str] = field(default_factory=list)  # paths of values kept as OpaqueObject
    notes: list[str] = field(default_factory=list)
    pending: PendingCheck | None = None  # set only by read_deferred(): wait before trusting the source


@dataclass
class ImportResult:
    """What an import wrote."""

    url: str
    kind: str
    tensors: int
    opaque: list[str]
    notes: list[str]
    seconds: float


#: Top-level keys whose non-negative int value is taken as the checkpoint's step.
STEP_KEYS = ("step", "global_step", "iteration")


def note_opaque_and_step(imported: Imported, opaque: list[str]) -> None:
    """What every pickle-based reader adds: a note listing opaque objects, and the step found in the state."""
    if opaque:
        shown = ", ".join(opaque[:10]) + (" ..." if len(opaque) > 10 else "")
        imported.notes.append(f"{len(opaque)} object(s) kept opaque (pickled, never run): {shown}")
    if isinstance(imported.state, dict):
        for key in STEP_KEYS:
            value = imported.state.get(key)
            if type(value) is int and value >= 0:
                imported.step = value
                imported.notes.append(f"step {value} taken from the state's {key!r}")
                break


Detect = Callable[[str], bool]
Read = Callable[[str], Imported]

#: kind -> module (inside this package) providing detect() and read(); detection tries them in order.
SOURCES: dict[str, str] = {
    "hf-trainer": "hf_trainer",
    "lightning": "lightning_format",
    "dcp": "dcp_format",
    "deepspeed": "deepspeed_format",
    "torch": "torch_format",
    "safetensors": "safetensors_format",
}


def source(kind: str) -> tuple[Detect, Read] | None:
    """(detect, read) of a source kind; None when its module is not available."""
    module = _module(kind)
    return None if module is None else (module.detect, module.read)


def _module(kind: str) -> ModuleType | None:
    module_name = SOURCES[kind]
    try:
        return importlib.import_module(f"{__package__}.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"{__package__}.{module_name}":
            return None
        raise


def available_kinds() -> list[str]:
    """The source kinds whose converters are installed, in detection order."""
    return [kind for kind in SOURCES if source(kind) is not None]


def detect_kind(path: str) -> str:
    """The first kind whose detect() accepts ``path``; CheckpointError when none does."""
    for kind in SOURCES:
        found = source(kind)
        if found is not None and found[0](path):
            return kind
    raise CheckpointError(f"{path}: not a checkpoint format ckptfmt can import "
                          f"(tried {', '.join(available_kinds())}); name one with --from / kind=")


def read_source(src: str | os.PathLike, kind: str | None = None, options: dict | None = None) -> Imported:
    """Read ``src`` (a local file) without saving anything; every check of the source has run.

    ``options`` go to the kind's reader as keyword arguments (deepspeed: ``tp_dims``).
    """
    return _read(src, kind, deferred=False, options=options)


def _read(src: str | os.PathLike, kind: str | None, deferred: bool, options: dict | None = None) -> Imported:
    """Read ``src``; with ``deferred``, through the kind's read_deferred() where it has one."""
    path = os.fspath(src)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such file")
    if kind is None:
        kind = detect_kind(path)
    elif kind not in SOURCES:
        raise CheckpointError(f"unknown source kind {kind!r}: choose from {', '.join(SOURCES)}")
    module = _module(kind)
    if module is None:
        raise CheckpointError(f"the {kind} importer is not available in this installation")
    read = getattr(module, "read_deferred", module.read) if deferred else module.read
    options = options or {}
    unknown = sorted(set(options) - set(inspect.signature(read).parameters))
    if unknown:
        raise CheckpointError(f"the {kind} importer takes no option {', '.join(unknown)}")
    try:
        imported = read(path, **options)
    except CheckpointError:
        raise
    except (OSError, ValueError, TypeError, KeyError, IndexError, EOFError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: cannot import as {kind} ({type(exc).__name__}: {exc})") from None
    if not isinstance(imported, Imported):
        raise TypeError(f"the {kind} reader returned a {type(imported).__name__}, not an Imported")
    return imported


def import_checkpoint(src: str | os.PathLike, dest: str | os.PathLike, *, kind: str | None = None,
                      storage_options: dict | None = None, step: int | None = None,
                      options: dict | None = None) -> ImportResult:
    """Import the checkpoint file ``src`` as the new ckptfmt checkpoint ``dest`` (``REPO/NAME``).

    ``kind`` names the source format (default: detected); ``step`` overrides the step the
    source recorded; ``options`` go to the kind's reader (deepspeed: ``tp_dims``). Raises
    CheckpointError naming the file and the problem; nothing is committed unless the whole
    import succeeds.
    """
    started = time.perf_counter()
    split_checkpoint_url(dest)  # a bare name is refused before the source is read
    timer = PhaseTimer()
    path = os.fspath(src)
    with timer.phase("read"):
        imported = _read(path, kind, deferred=True, options=options)
    try:
        url = _save(imported, path, dest, timer, storage_options, step)
    except BaseException:
        if imported.pending is not None:
            imported.pending.cancel()
        raise
    with ckptfmt.open(url, storage_options=storage_options) as reader:
        tensors = reader.manifest.totals.get("tensor_count", 0)
    notes = list(imported.notes)
    if imported.rng is None:
        notes.append("the source holds no RNG states in a known form: none recorded (restore_rng will refuse)")
    return ImportResult(url, imported.kind, tensors, list(imported.opaque), notes, time.perf_counter() - started)


def _save(imported: Imported, path: str, dest: str | os.PathLike, timer: PhaseTimer, storage_options: dict | None,
          step: int | None) -> str:
    """ckptfmt.save of ``imported`` with its provenance; pending checks must pass before the commit."""
    if isinstance(imported.state, (torch.Tensor, np.ndarray)):  # torch.save(tensor): a key is needed
        imported.state = {"tensor": imported.state}
        imported.notes.append("the source holds a bare tensor: stored under the key 'tensor'")
    provenance = {
        "source_kind": imported.kind,
        "source": os.path.abspath(path),
        "versions": dict(imported.versions),
        "opaque_objects": list(imported.opaque),
        # The save's own phases are in the manifest's `timing`; this is what came before it.
        "timing": list(timer.phases),
    }
    return ckptfmt.save(
        imported.state, dest, step=step if step is not None else imported.step,
        metadata=imported.metadata, storage_options=storage_options,
        # [] rather than None: never record this importing process's generators as the run's.
        rng=imported.rng if imported.rng is not None else [],
        provenance=provenance,
        before_commit=None if imported.pending is None else imported.pending.wait,
    )


__all__ = ["ImportResult", "Imported", "SOURCES", "available_kinds", "detect_kind", "import_checkpoint",
           "read_source", "source"]
