"""ckptfmt and the baseline formats behind one calling convention.

* saver(state, out_dir, name) -> checkpoint path (or ckptfmt url); durable on return.
  ckptfmt writes into the repo ``out_dir/repo``; torch.save and safetensors
  fsync the file and ``out_dir``; DCP fsyncs its files (``sync_files=True``).
* loader(path, like) -> an object holding every tensor (``like`` is the
  reference state, used by DCP to preallocate its destination tensors).
* lazy reader(path, key) -> the ``touch`` checksum of that single tensor,
  computed while the reader is still open.

ckptfmt is imported once up front (so import time never lands in a timing); if
the import fails, or a function is missing, every ckptfmt call raises and the
benchmark reports that row as an error.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch as st
import torch
import torch.distributed.checkpoint as dcp
from harness import fsync_path, touch
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

try:
    import ckptfmt as _ckptfmt

    _IMPORT_ERROR: Exception | None = None
except Exception as exc:
    _ckptfmt, _IMPORT_ERROR = None, exc

# DCP warns on every call that no process group is initialised; single-process is intended.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

State = Mapping[str, torch.Tensor]


def ckptfmt_api() -> Any:
    """The ckptfmt module, or a RuntimeError saying why it could not be imported."""
    if _ckptfmt is None:
        raise RuntimeError(f"cannot import ckptfmt: {_IMPORT_ERROR!r}")
    return _ckptfmt


def resolve_key(keys: Any, key: str) -> str:
    """``key`` as ckptfmt names it: the flat dict key, or its '/'-joined form."""
    available = set(keys)
    for candidate in (key, key.replace(".", "/")):
        if candidate in available:
            return candidate
    raise KeyError(f"{key!r} not among {len(available)} keys, e.g. {sorted(available)[:3]}")


# --------------------------------------------------------------------------- savers


def save_ckptfmt(state: State, out: Path, name: str, **options: Any) -> str:
    """ckptfmt.save into the repo ``out/repo`` (created on first save)."""
    url = f"{out}/repo/{name}"
    ckptfmt_api().save(state, url, **options)
    return url


def save_torch(state: State, out: Path, name: str) -> str:
    """torch.save, then fsync of the file and its directory."""
    path = out / f"{name}.pt"
    torch.save(state, path)
    fsync_path(path)
    fsync_path(out)
    return str(path)


def save_safetensors(state: State, out: Path, name: str) -> str:
    """safetensors save_file, then fsync of the file and its directory."""
    path = out / f"{name}.safetensors"
    st.save_file(state, path)
    fsync_path(path)
    fsync_path(out)
    return str(path)


def save_dcp(state: State, out: Path, name: str) -> str:
    """torch.distributed.checkpoint.save with 2 writer threads (fsyncs by default)."""
    path = out / name
    dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=2))
    return str(path)


SAVERS: dict[str, Callable[..., str]] = {
    "ckptfmt": save_ckptfmt,
    "torch.save": save_torch,
    "safetensors": save_safetensors,
    "DCP": save_dcp,
}


# -------------------------------------------------------------------------- loaders


def load_ckptfmt(path: str, like: State) -> Any:
    """ckptfmt.load (verifies hashes)."""
    return ckptfmt_api().load(path)


def load_safetensors(path: str, like: State) -> Any:
    """safetensors.torch.load_file."""
    return st.load_file(path)


def load_torch_mmap(path: str, like: State) -> Any:
    """torch.load(mmap=True, weights_only=True)."""
    return torch.load(path, mmap=True, weights_only=True)


def load_dcp(path: str, like: State) -> Any:
    """DCP load into freshly allocated tensors shaped like the reference state."""
    state = {key: torch.empty_like(value) for key, value in like.items()}
    dcp.load(state, storage_reader=FileSystemReader(path))
    return state


LOADERS: dict[str, Callable[[str, State], Any]] = {
    "ckptfmt": load_ckptfmt,
    "safetensors": load_safetensors,
    "torch.load(mmap)": load_torch_mmap,
    "DCP": load_dcp,
}
# Which saver produced the checkpoint each loader reads.
LOADER_SOURCE = {"ckptfmt": "ckptfmt", "safetensors": "safetensors",
                 "torch.load(mmap)": "torch.save", "DCP": "DCP"}


# --------------------------------------------------------------------- lazy readers


def lazy_ckptfmt(path: str, key: str) -> float:
    """ckptfmt.open + get_tensor of one tensor."""
    with ckptfmt_api().open(path) as reader:
        return touch(reader.get_tensor(resolve_key(reader.keys(), key)))


def lazy_safetensors(path: str, key: str) -> float:
    """safetensors safe_open + get_tensor of one tensor."""
    with safe_open(path, framework="pt") as reader:
        return touch(reader.get_tensor(key))


LAZY_READERS: dict[str, Callable[[str, str], float]] = {
    "ckptfmt": lazy_ckptfmt,
    "safetensors": lazy_safetensors,
}
