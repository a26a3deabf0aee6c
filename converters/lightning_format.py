"""PyTorch Lightning ``.ckpt`` files, for ``ckptfmt import`` (kind ``"lightning"``).

A Lightning checkpoint is a ``torch.save`` file (zip, or legacy for very old versions)
whose top-level dict holds ``state_dict``, ``optimizer_states``, ``lr_schedulers``,
``loops``, ``callbacks``, ``hyper_parameters``, ``epoch``, ``global_step`` and
``pytorch-lightning_version``. It is read with the torch reader (``torch_format.read``:
its pickle is never run; objects of classes ckptfmt has no exact type for, such as
custom hyper-parameter objects or ``AttributeDict``, are kept opaque and reported), and
the whole dict is the imported state. The step is ``global_step``; ``versions`` names
the Lightning version that wrote the file. Lightning itself is never imported.
"""

from __future__ import annotations

import os
import zipfile

from ckptfmt.converters import torch_format
from ckptfmt.converters.importer import Imported
from ckptfmt.errors import CheckpointError

VERSION_KEY = "pytorch-lightning_version"
#: How much of a legacy-format file detect() scans for the keys (the main pickle comes first).
_LEGACY_SCAN = 16 << 20
_MAX_DETECT_PICKLE = 256 << 20


def _pickle_strings(*words: str) -> list[tuple[bytes, ...]]:
    """The forms a str key takes in a pickle: BINUNICODE (protocol 2, torch.save's default) and SHORT_BINUNICODE."""
    forms = []
    for word in words:
        raw = word.encode("utf-8")
        forms.append((b"X" + len(raw).to_bytes(4, "little") + raw, b"\x8c" + bytes([len(raw)]) + raw))
    return forms


_VERSION, _STATE_DICT, _LOOPS, _CALLBACKS, _GLOBAL_STEP = _pickle_strings(
    VERSION_KEY, "state_dict", "loops", "callbacks", "global_step")


def _has(blob: bytes, forms: tuple[bytes, ...]) -> bool:
    return any(form in blob for form in forms)


def _looks_like_lightning(blob: bytes) -> bool:
    if _has(blob, _VERSION):
        return True
    return _has(blob, _STATE_DICT) and _has(blob, _GLOBAL_STEP) and (_has(blob, _LOOPS) or _has(blob, _CALLBACKS))


def detect(path: str) -> bool:
    """A torch.save file whose pickle has Lightning's top-level keys (checked on the pickle bytes only)."""
    path = os.fspath(path)
    if not os.path.isfile(path) or not torch_format.detect(path):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        if head == b"PK\x03\x04":
            with zipfile.ZipFile(path) as zf:
                names = [i for i in zf.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
                if len(names) != 1 or names[0].file_size > _MAX_DETECT_PICKLE:
                    return False
                blob = zf.read(names[0])
        else:
            with open(path, "rb") as f:
                blob = f.read(_LEGACY_SCAN)
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, RuntimeError):
        return False
    return _looks_like_lightning(blob)


def read(path: str) -> Imported:
    """Read a Lightning .ckpt: the whole checkpoint dict is the state (raises CheckpointError naming the file)."""
    path = os.fspath(path)
    imported = torch_format.read(path)
    state = imported.state
    if not isinstance(state, dict) or not (
        VERSION_KEY in state or ("state_dict" in state and ("loops" in state or "callbacks" in state))
    ):
        raise CheckpointError(f"{path}: not a Lightning checkpoint (no {VERSION_KEY!r}, or no 'state_dict' "
                              "with 'loops' / 'callbacks' at the top level)")
    imported.kind = "lightning"
    imported.notes = [n for n in imported.notes if not n.startswith("step ")]
    step = state.get("global_step")
    if type(step) is int and step >= 0:
        imported.step = step
        imported.notes.append(f"step {step} taken from the checkpoint's 'global_step'")
    else:
        imported.step = None
        imported.notes.append("the checkpoint has no integer 'global_step': no step recorded")
    version = state.get(VERSION_KEY)
    versions = {"lightning": str(version)} if isinstance(version, str) else {}
    if not versions:
        imported.notes.append(f"no {VERSION_KEY!r} in the checkpoint: the Lightning version is unknown")
    versions.update(imported.versions)
    imported.versions = versions
    metadata = {}
    for key in ("epoch", "global_step", VERSION_KEY, "hparams_name"):
        if key in state and (state[key] is None or type(state[key]) in (int, float, str, bool)):
            metadata[f"lightning_{key.replace('pytorch-lightning_', '')}"] = state[key]
    metadata["lightning_keys"] = [str(k) for k in state]
    imported.metadata = metadata
    return imported
