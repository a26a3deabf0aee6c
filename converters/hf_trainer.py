"""Hugging Face Trainer ``checkpoint-N`` folders, for ``ckptfmt import`` (kind ``"hf-trainer"``).

What ``Trainer._save_checkpoint`` writes, and where it goes in the imported checkpoint:

- model weights: ``model.safetensors``, a sharded set (``model.safetensors.index.json``
  and ``model-*.safetensors``), ``pytorch_model.bin`` (or its sharded set), or a PEFT
  adapter (``adapter_model.safetensors`` / ``.bin``) -> ``state["model"]``;
- ``optimizer.pt`` -> ``state["optimizer"]``, ``scheduler.pt`` -> ``state["scheduler"]``,
  ``scaler.pt`` (older versions' AMP GradScaler) -> ``state["scaler"]``;
- ``training_args.bin`` (a pickled ``TrainingArguments``) -> ``state["training_args"]``: the
  pickle is never run, so it is kept as an opaque object (restored as it came on export);
- ``rng_state.pth`` or one ``rng_state_{i}.pth`` per process -> the RNG entries (rank 0,
  or rank i), in ckptfmt's format, so ``ckptfmt.restore_rng`` applies them;
- ``trainer_state.json`` -> the step (``global_step``) and metadata (``epoch``,
  ``log_history``, best metric and checkpoint, ...); ``config.json`` /
  ``generation_config.json`` -> metadata. ``versions["transformers"]`` comes from them.

Every torch file goes through ``torch_format.read`` (restricted unpickler; never
``torch.load``). transformers itself is never imported. Anything else in the folder
(tokenizer files, a DeepSpeed ``global_stepN/`` or FSDP sub-folder) is not imported and is
listed in the notes. A folder without
``trainer_state.json`` is still read (the step then comes from its ``checkpoint-N`` name);
a damaged file raises ``CheckpointError`` naming it.
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
from typing import Any

import numpy as np
import torch

from ckptfmt.converters import safetensors_format, torch_format
from ckptfmt.converters.importer import Imported
from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, ManifestError
from ckptfmt.format.rng_states import numpy_state_tuple, pack_python_words, python_state_tuple
from ckptfmt.format.values import format_key

TRAINER_STATE = "trainer_state.json"
TRAINING_ARGS = "training_args.bin"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
SCALER = "scaler.pt"  # the AMP GradScaler, written by older transformers versions
#: Model weight layouts in the order transformers looks for them.
WEIGHTS = (
    ("model.safetensors.index.json", "safetensors"),
    ("model.safetensors", "safetensors"),
    ("pytorch_model.bin.index.json", "torch-index"),
    ("pytorch_model.bin", "torch"),
    ("adapter_model.safetensors", "safetensors"),
    ("adapter_model.bin", "torch"),
)
_RNG_FILE = re.compile(r"rng_state(?:_(\d+))?\.pth\Z")
_CHECKPOINT_DIR = re.compile(r"checkpoint-(\d+)\Z")
#: Files that, without trainer_state.json, still mark a folder as written by the Trainer.
_TRAINER_FILES = (TRAINING_ARGS, OPTIMIZER, SCHEDULER)
_TRAINER_STATE_KEYS = ("epoch", "global_step", "max_steps", "num_train_epochs", "logging_steps", "eval_steps",
                       "save_steps", "train_batch_size", "total_flos", "num_input_tokens_seen", "best_metric",
                       "best_global_step", "best_model_checkpoint", "is_hyper_param_search", "trial_name",
                       "trial_params", "log_history", "stateful_callbacks")


def _folder(path: str) -> str:
    path = os.fspath(path)
    if os.path.isfile(path) and os.path.basename(path) == TRAINER_STATE:
        return os.path.dirname(path) or "."
    return path


def _rng_files(folder: str) -> list[tuple[int, str]]:
    found = []
    for name in os.listdir(folder):
        match = _RNG_FILE.match(name)
        if match and os.path.isfile(os.path.join(folder, name)):
            found.append((int(match.group(1)) if match.group(1) is not None else 0, name))
    return sorted(found)


def detect(path: str) -> bool:
    """A folder with trainer_state.json (or that file itself), or with the Trainer's optimizer/args/RNG files."""
    folder = _folder(path)
    try:
        if not os.path.isdir(folder):
            return False
        names = set(os.listdir(folder))
    except OSError:
        return False
    if TRAINER_STATE in names:
        return True
    return any(n in names for n in _TRAINER_FILES) or any(_RNG_FILE.match(n) for n in names)


def read(path: str) -> Imported:
    """Read a Trainer checkpoint folder (raises CheckpointError naming the file at fault)."""
    folder = _folder(path)
    if not os.path.isdir(folder):
        raise CheckpointNotFoundError(
            f"{folder}: not a folder (a Hugging Face Trainer checkpoint is a checkpoint-N folder)"
        )
    names = set(os.listdir(folder))
    notes: list[str] = []
    opaque: list[str] = []
    metadata: dict[str, Any] = {}
    versions: dict[str, str] = {}
    state: dict[str, Any] = {}

    # trainer_state.json: step and training metadata
    step = _step(folder, names, metadata, notes)

    for name in ("config.json", "generation_config.json"):
        if name in names:
            config = _json(folder, name)
            metadata[name.replace(".json", "")] = config
            if isinstance(config, dict) and isinstance(config.get("transformers_version"), str):
                versions.setdefault("transformers", config["transformers_version"])

    # model weights
    weights = _model(folder, names, state, metadata, versions, opaque, notes)
    weights_path = os.path.join(folder, weights[0])

    consumed = {TRAINER_STATE, "config.json", "generation_config.json", weights[0]}
    consumed.update(_shard_files(weights_path) if weights[0].endswith(".index.json") else ())
    for name, key in ((OPTIMIZER, "optimizer"), (SCHEDULER, "scheduler"), (SCALER, "scaler"),
                      (TRAINING_ARGS, "training_args")):
        if name in names:
            state[key] = _torch_part(os.path.join(folder, name), key, opaque, notes)
            consumed.add(name)
        elif name in (OPTIMIZER, SCHEDULER):
            notes.append(f"no {name} in the folder")

    # RNG states
    rng_files = _rng_files(folder)
    rng = _rng_states(folder, rng_files, notes)
    consumed.update(name for _, name in rng_files)
    left = sorted(n + ("/" if os.path.isdir(os.path.join(folder, n)) else "") for n in names - consumed)
    if left:
        notes.append(f"not imported: {', '.join(left)}")

    if opaque:
        shown = ", ".join(opaque[:10]) + (" ..." if len(opaque) > 10 else "")
        notes.append(f"{len(opaque)} object(s) kept opaque (pickled, never run): {shown}")
    return Imported(state=state, kind="hf-trainer", step=step, metadata=metadata, rng=rng or None,
                    versions=versions, opaque=opaque, notes=notes)


def _step(folder: str, names: set[str], metadata: dict[str, Any], notes: list[str]) -> int | None:
    """The step, from trainer_state.json (whose keys go to ``metadata``) or else the folder's name."""
    step: int | None = None
    trainer_state = _json(folder, TRAINER_STATE) if TRAINER_STATE in names else None
    if trainer_state is not None:
        if not isinstance(trainer_state, dict):
            raise ManifestError(f"{os.path.join(folder, TRAINER_STATE)}: not a JSON object")
        metadata["trainer_state"] = {k: trainer_state[k] for k in _TRAINER_STATE_KEYS if k in trainer_state}
        others = sorted(k for k in trainer_state if k not in _TRAINER_STATE_KEYS)
        for key in others:
            metadata["trainer_state"][key] = trainer_state[key]
        global_step = trainer_state.get("global_step")
        if type(global_step) is int and global_step >= 0:
            step = global_step
        else:
            notes.append(f"{TRAINER_STATE} has no integer global_step")
    else:
        notes.append(f"{folder}: no {TRAINER_STATE}: no log history or epoch recorded")
    if step is None:
        match = _CHECKPOINT_DIR.match(os.path.basename(os.path.normpath(os.path.abspath(folder))))
        if match:
            step = int(match.group(1))
            notes.append(f"step {step} taken from the folder name")
        else:
            notes.append("no step found (no trainer_state.json global_step, folder not named checkpoint-N)")
    return step


def _model(folder: str, names: set[str], state: dict[str, Any], metadata: dict[str, Any], versions: dict[str, str],
           opaque: list[str], notes: list[str]) -> tuple[str, str]:
    """The model weights read into ``state["model"]``; (their file, how they are stored)."""
    weights = next(((name, how) for name, how in WEIGHTS if name in names), None)
    if weights is None:
        raise CheckpointNotFoundError(
            f"{folder}: no model weights (looked for {', '.join(name for name, _ in WEIGHTS)})")
    weights_path = os.path.join(folder, weights[0])
    if weights[1] == "safetensors":
        model = safetensors_format.read(weights_path)
        metadata.update({k: v for k, v in model.metadata.items() if k.startswith("safetensors")})
        versions.update({k: v for k, v in model.versions.items()})
        notes.extend(model.notes)
        state["model"] = model.state
    elif weights[1] == "torch":
        state["model"] = _torch_part(weights_path, "model", opaque, notes)
    else:
        state["model"] = _torch_shards(weights_path, opaque, notes)
    metadata["model_weights"] = weights[0]
    if weights[0].startswith("adapter_"):
        notes.append(f"only the adapter weights ({weights[0]}) are in this folder")
    return weights


def _rng_states(folder: str, rng_files: list[tuple[int, str]], notes: list[str]) -> list:
    """The RNG state of each rank's file (one file a rank)."""
    ranks = [rank for rank, _ in rng_files]
    if len(set(ranks)) != len(ranks):
        raise CheckpointError(f"{folder}: two RNG files for one rank ({', '.join(n for _, n in rng_files)})")
    rng = [_rng_entry(os.path.join(folder, name), rank, notes) for rank, name in rng_files]
    if not rng:
        notes.append("no rng_state*.pth: no RNG states recorded")
    return rng


def _json(folder: str, name: str) -> Any:
    path = os.path.join(folder, name)
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from exc


def _torch_part(path: str, key: str, opaque: list[str], notes: list[str]) -> Any:
    """One torch.save file, read without running its pickle; its opaque paths are put under ``key``."""
    part = torch_format.read(path)
    for where in part.opaque:
        opaque.append(key if where == "<root>" else f"{format_key((key,))}/{where}")
    name = os.path.basename(path)
    notes.extend(f"{name}: {n}" for n in part.notes
                 if not n.startswith(("step ", f"{len(part.opaque)} object(s) kept opaque")))
    return part.state


def _shard_files(index_path: str) -> set[str]:
    index = _json(os.path.dirname(index_path), os.path.basename(index_path))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    return {v for v in weight_map.values() if isinstance(v, str)} if isinstance(weight_map, dict) else set()


def _torch_shards(index_path: str, opaque: list[str], notes: list[str]) -> dict:
    """A sharded pytorch_model-*.bin set, in its index's order."""
    index = _json(os.path.dirname(index_path), os.path.basename(index_path))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ManifestError(f"{index_path}: no weight_map of tensor name -> shard file")
    folder = os.path.dirname(index_path)
    merged: dict[str, Any] = {}
    for shard in dict.fromkeys(weight_map.values()):
        if os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
            raise ManifestError(f"{index_path}: shard {shard!r} is outside the index's folder")
        shard_path = os.path.join(folder, shard)
        if not os.path.isfile(shard_path):
            raise CheckpointNotFoundError(f"{index_path}: shard file {shard_path} is missing")
        part = _torch_part(shard_path, "model", opaque, notes)
        if not isinstance(part, dict):
            raise CheckpointError(f"{shard_path}: not a state dict")
        for name, value in part.items():
            if name in merged:
                raise CheckpointError(f"{shard_path}: tensor {name!r} is also in another shard")
            merged[name] = value
    missing = [n for n in weight_map if n not in merged]
    if missing:
        raise CheckpointError(f"{index_path}: {len(missing)} listed tensor(s) are in no shard, e.g. {missing[0]!r}")
    return {name: merged[name] for name in weight_map} | {n: v for n, v in merged.items() if n not in weight_map}


def _state_bytes(value: Any, what: str) -> bytes:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise CheckpointError(f"{what}: expected a 1-d uint8 tensor, found {type(value).__name__}")
    return value.contiguous().numpy().tobytes()


def _rng_entry(path: str, rank: int, notes: list[str]) -> dict:
    """The Trainer's RNG dict ({"python", "numpy", "cpu", "cuda", ...}) as a ckptfmt RNG entry."""
    name = os.path.basename(path)
    states = torch_format.read(path).state
    if not isinstance(states, dict) or "cpu" not in states:
        raise CheckpointError(f"{path}: not a Trainer RNG state (a dict with 'cpu', 'numpy', 'python')")
    entry: dict[str, Any] = {"rank": rank, "torch_cpu": _state_bytes(states["cpu"], f"{path}: 'cpu'")}
    try:  # a private generator checks the state and gives its seed: the process's generator is left alone
        generator = torch.Generator()
        generator.set_state(states["cpu"].contiguous())
        entry["torch_initial_seed"] = generator.initial_seed()
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: 'cpu' is not a torch CPU generator state ({exc})") from None
    entry["cuda"] = []
    cuda = states.get("cuda")
    if cuda is not None:
        cuda_list = list(cuda) if isinstance(cuda, (list, tuple)) else [cuda]
        entry["cuda"] = [_state_bytes(s, f"{path}: 'cuda'") for s in cuda_list]
        if not isinstance(cuda, (list, tuple)):
            notes.append(f"{name}: one CUDA generator state (the process's current device) recorded as device 0's")
    numpy_state = states.get("numpy")
    if numpy_state is not None:
        try:
            bit_generator, keys, pos, has_gauss, cached = numpy_state
            keys = np.asarray(keys)
            if type(bit_generator) is not str or keys.dtype.kind not in "iu" or keys.ndim != 1:
                raise TypeError("malformed")
            entry["numpy"] = {"bit_generator": bit_generator, "keys": keys.astype("<u4").tobytes(),
                              "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
            np.random.RandomState().set_state(numpy_state_tuple(entry["numpy"]))  # what a restore checks
        except (TypeError, ValueError, OverflowError) as exc:
            raise CheckpointError(f"{path}: 'numpy' is not a numpy.random.get_state() tuple ({exc})") from None
    python_state = states.get("python")
    if python_state is not None:
        try:
            version, internal, gauss_next = python_state
            if type(version) is not int or not all(type(v) is int for v in internal) or \
                    not (gauss_next is None or type(gauss_next) is float):
                raise TypeError("malformed")
            entry["python"] = {"version": version, "state": pack_python_words(internal), "gauss_next": gauss_next}
            random.Random().setstate(python_state_tuple(entry["python"]))  # what a restore checks: its position
        except (TypeError, ValueError, OverflowError, struct.error) as exc:
            raise CheckpointError(f"{path}: 'python' is not a random.getstate() tuple ({exc})") from None
    others = sorted(str(k) for k in states if k not in ("cpu", "cuda", "numpy", "python"))
    if others:
        notes.append(f"{name}: generator states of {', '.join(others)} have no place in ckptfmt's RNG entries "
                      "and were not imported")
    return entry
