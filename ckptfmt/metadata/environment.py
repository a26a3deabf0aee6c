"""What software and hardware wrote a checkpoint, and how deterministic it was set to be.

Package versions and the git state are read once per process (they cost tens of
milliseconds); determinism settings are read at every save since code can change them.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import socket
import subprocess

import msgpack
import torch

_DETERMINISM_ENV = ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED", "CUDA_LAUNCH_BLOCKING", "OMP_NUM_THREADS")


def capture_environment() -> dict:
    """The environment record of the manifest (all values plain msgpack types)."""
    return {
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation()},
        "torch": _torch_versions(),
        "os": {"system": platform.system(), "release": platform.release(), "platform": platform.platform()},
        "hostname": socket.gethostname(),
        "cpu": _cpu(),
        "gpus": _gpus(),
        "packages": _packages(),
        "git": _git_state(os.getcwd()),
        "determinism": capture_determinism(),
    }


def merge_environments(environments: list[dict]) -> dict:
    """The manifest's environment record for several ranks (spec 9.3): the first rank's environment and
    the ranks that share it, then each other distinct environment with its ranks."""
    distinct: list[tuple[bytes, dict, list[int]]] = []
    for rank, environment in enumerate(environments):
        encoded = msgpack.packb(environment, use_bin_type=True)
        match = next((d for d in distinct if d[0] == encoded), None)
        if match is None:
            distinct.append((encoded, environment, [rank]))
        else:
            match[2].append(rank)
    (_, first, first_ranks), others = distinct[0], distinct[1:]
    result = {**first, "ranks": first_ranks}
    if others:
        result["others"] = [{**environment, "ranks": ranks} for _, environment, ranks in others]
    return result


def capture_determinism() -> dict:
    """Settings that decide whether a run can be reproduced bit for bit."""
    cudnn = torch.backends.cudnn
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_enabled": bool(cudnn.enabled),
        "cudnn_deterministic": bool(cudnn.deterministic),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "cudnn_allow_tf32": bool(cudnn.allow_tf32),
        "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "num_threads": torch.get_num_threads(),
        "env": {name: os.environ.get(name) for name in _DETERMINISM_ENV},
    }


def _torch_versions() -> dict:
    cuda_available = torch.cuda.is_available()
    versions = {
        "version": torch.__version__,
        "git_version": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        # cuDNN's version check reads each device's capability, initialising CUDA: see _uses_cuda
        "cudnn": torch.backends.cudnn.version() if _uses_cuda() and torch.backends.cudnn.is_available() else None,
        "nccl": None,
        "cuda_available": cuda_available,
    }
    if cuda_available:
        try:
            versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL is absent from some builds
            pass
    return versions


@functools.lru_cache(maxsize=1)
def _cpu() -> dict:
    model = platform.processor() or None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"model": model, "count": os.cpu_count(), "machine": platform.machine()}


def _uses_cuda() -> bool:
    """Whether this process has initialised CUDA. A save must not be the one to do it (its forked data
    loader workers could not use CUDA, its step signatures would digest generators it never used), so
    what only CUDA's initialisation can read (the GPUs, cuDNN's version) is recorded where it is done."""
    return torch.cuda.is_initialized()


def _gpus() -> list:
    """The GPUs of a process that uses CUDA (see ``_uses_cuda``)."""
    if not _uses_cuda():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({
            "index": index,
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_bytes": int(props.total_memory),
        })
    return gpus


@functools.lru_cache(maxsize=1)
def _packages() -> dict:
    """Every installed distribution's version by lowercase name (the first found, as imports do).

    Only the ``Name`` and ``Version`` headers are read: parsing each whole
    METADATA file with the email parser cost the first save of a process
    0.3-1.3 s for 133 packages.
    """
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name, version = _name_and_version(dist.read_text("METADATA") or dist.read_text("PKG-INFO") or "")
        if name and version:
            found.setdefault(name.lower(), version)
    return dict(sorted(found.items()))


def _name_and_version(metadata: str) -> tuple[str | None, str | None]:
    """The ``Name`` and ``Version`` of a core metadata file: headers, up to the first empty line."""
    headers: dict[str, str] = {}
    for line in metadata.splitlines():
        if not line:
            break
        field, colon, value = line.partition(":")
        if colon and field in ("Name", "Version"):
            headers.setdefault(field, value.strip())
    return headers.get("Name"), headers.get("Version")


@functools.lru_cache(maxsize=8)
def _git_state(directory: str) -> dict | None:
    """Commit and dirty flag of the repository around ``directory``, if there is one."""
    def git(*args: str) -> str:
        result = subprocess.run(
            ["git", *args], cwd=directory, capture_output=True, text=True, timeout=5, check=True
        )
        return result.stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


