"""Accelerate: what ``accelerator.save_state`` saves, as one collective ckptfmt checkpoint.

    from ckptfmt.integrations.accelerate import StepTiming, load_state, save_state

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    StepTiming(accelerator)                       # every step timed on every rank, from torch's hooks
    ...
    save_state(accelerator, "s3://bucket/run/step-000400")      # instead of accelerator.save_state(dir)
    ...
    load_state(accelerator, "s3://bucket/run/step-000400")      # instead of accelerator.load_state(dir)

The checkpoint holds what Accelerate's folder holds: every prepared model and
optimizer (through torch's distributed state-dict API, so sharded FSDP2 states
are saved as each rank's shards and loaded in place at any world size),
scheduler, the seedable samplers' epochs and stateful data loaders' positions,
the GradScaler, every object given to ``register_for_checkpointing``,
Accelerate's step counter, and every rank's RNG states. Every rank calls both
functions. With ``ProjectConfiguration(automatic_checkpoint_naming=True)``,
``save_state(accelerator)`` names checkpoints ``checkpoint_N`` in
``project_dir/checkpoints`` and keeps ``total_limit`` of them, and
``load_state(accelerator)`` loads the newest, as Accelerate does with folders.
"""

from __future__ import annotations

import copy
import os
import re
import warnings
import weakref
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWarning
from ckptfmt.integrations.step_hooks import HookedStepTimer
from ckptfmt.lifecycle.gc import collect, remove
from ckptfmt.loading.load_into import load_into
from ckptfmt.loading.reader import open as open_checkpoint
from ckptfmt.loading.reader import restore_rng
from ckptfmt.loading.resume_check import check_generators, check_parts, record_resume
from ckptfmt.repository.repository import Repository
from ckptfmt.saving.save import save

#: Accelerate's own folder name under automatic checkpoint naming.
_AUTOMATIC_NAME = re.compile(r"checkpoint_(\d+)")
#: Distributed types whose engines save their own state (Accelerate defers to them too).
_ENGINES = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.MEGATRON_LM: "Megatron-LM"}
#: Where a checkpoint holds each data loader's shape (``_loader_shape``), beside its position.
LOADERS_KEY = "dataloader_shapes"
#: The StepTiming of each Accelerator, found by save_state.
_TIMINGS: weakref.WeakKeyDictionary[Accelerator, StepTiming] = weakref.WeakKeyDictionary()


def save_state(accelerator: Accelerator, url: str | os.PathLike | None = None, *, step: int | None = None,
               storage_options: dict | None = None, **save_options: Any) -> str:
    """Save the accelerator's whole training state as the checkpoint ``url``; every rank calls it.

    ``url`` None: ``checkpoint_N`` of ``project_dir/checkpoints`` under automatic checkpoint naming,
    the oldest removed beyond ``total_limit``. ``step``: the training step the checkpoint is of
    (default: the steps ``StepTiming`` counted, if there is one). Other keywords are
    ``ckptfmt.save``'s (``compression``, ``chunk_size``, ...). Returns the checkpoint's URL.
    """
    _refuse_engines(accelerator)
    if accelerator._save_model_state_pre_hook:
        warnings.warn(CheckpointWarning("save_state: hooks registered with register_save_state_pre_hook are not "
                                        "run (they write into Accelerate's folder; there is none)"), stacklevel=2)
    config = accelerator.project_configuration
    automatic = url is None
    if url is None:
        if not config.automatic_checkpoint_naming:
            raise ValueError("save_state(accelerator) without a URL needs ProjectConfiguration("
                             "automatic_checkpoint_naming=True)")
        url = f"{_automatic_repo(accelerator)}/checkpoint_{config.iteration}"
    timing = _TIMINGS.get(accelerator)
    if timing is not None:
        timing.run_pending()  # a resume's record not made yet (no step since the load) goes with this save
    state = _training_state(accelerator)
    state[LOADERS_KEY] = {f"dataloader_{index}": _loader_shape(accelerator, loader)
                          for index, loader in enumerate(accelerator._dataloaders)}
    if timing is not None:
        state["step_timing"] = {"steps_started": timing.steps_started}
    if step is None and timing is not None:
        step = timing.steps_started
    saved = save(state, url, storage_options=storage_options, step=step,
                 timer=timing.timer if timing is not None else None, **save_options)
    config.iteration += 1
    if automatic and config.total_limit is not None and accelerator.is_main_process:
        _keep_newest(_automatic_repo(accelerator), config.total_limit, storage_options)
    accelerator.wait_for_everyone()
    return saved


def load_state(accelerator: Accelerator, url: str | os.PathLike | None = None, *,
               storage_options: dict | None = None, strict: bool = True) -> None:
    """Load a checkpoint written by ``save_state`` into the accelerator's prepared objects, in place,
    and restore this rank's RNG states; every rank calls it. What the objects then hold is compared
    with the checkpoint part by part (``ckptfmt.record_resume``) and goes on record in the next save:
    with ``StepTiming``, the models, optimizers and schedulers when the first step begins (what the
    loop's own code did to them after the load is on record too), the rest at once.

    ``url`` None: the newest ``checkpoint_N`` under automatic checkpoint naming. Sharded states are
    loaded as this run shards them, whatever the world size that saved them.
    """
    _refuse_engines(accelerator)
    if url is None:
        if not accelerator.project_configuration.automatic_checkpoint_naming:
            raise ValueError("load_state(accelerator) without a URL needs ProjectConfiguration("
                             "automatic_checkpoint_naming=True)")
        url = _newest(_automatic_repo(accelerator), storage_options)
    in_place = _in_place_states(accelerator)
    with open_checkpoint(url, storage_options=storage_options) as reader:
        rest = reader.load_state(without=in_place)
        missing = [name for name in _entries_by_value(accelerator, in_place) if name not in rest]
        if missing:  # before anything is loaded
            raise CheckpointError(f"{reader.url}: no {', '.join(map(repr, missing))} in the checkpoint: it was "
                                  f"saved with other prepared objects than this run's (it holds {sorted(rest)})")
        # a data position this run cannot continue from is refused before anything is loaded
        resharded = _loaders_at_another_shape(accelerator, rest, reader.manifest.topology, reader.url)
        load_into(reader, in_place, strict=strict, rank=accelerator.process_index, within=in_place)
        restore_rng(reader, rank=accelerator.process_index)
        generators = check_generators(reader, rank=accelerator.process_index)
        for index, model in enumerate(accelerator._models):
            set_model_state_dict(model, in_place[f"model_{index}"])
        for index, optimizer in enumerate(accelerator._optimizers):
            owner, name = _owner(accelerator, optimizer), f"optimizer_{index}"
            if owner is not None:
                set_optimizer_state_dict(owner, _torch_optimizer(optimizer), optim_state_dict=in_place[name])
            else:
                optimizer.load_state_dict(rest[name])
        _restore_rest(accelerator, rest, resharded)
        # What the prepared objects hold, part by part against the checkpoint: on record in the next save.
        # The models, optimizers and schedulers are compared when the first step begins (with StepTiming), so
        # that the loop's own code after the load (a state dropped, a schedule reset) is on record too; the
        # rest (data loaders' positions, which the first batch moves) at once.
        state = _training_state(accelerator)
        timing = _TIMINGS.get(accelerator)
        if timing is None:
            record_resume(reader, state, rank=accelerator.process_index, checked=[generators],
                          loaders=_loader_names(state))
            return
        late = [name for name in state if name.startswith(("model_", "optimizer_", "scheduler_"))]
        early = check_parts(reader, {name: value for name, value in state.items() if name not in late},
                            rank=accelerator.process_index, loaders=_loader_names(state))

    def record() -> None:
        now = _training_state(accelerator)
        record_resume(url, {name: now[name] for name in late}, storage_options=storage_options,
                      rank=accelerator.process_index, checked=[*early, generators])
    timing.at_next_step(record)


class StepTiming(HookedStepTimer):
    """Times every training step of this rank from hooks on the prepared models and optimizers, and
    hands the steps to ``save_state``; make it once, after ``accelerator.prepare``.

    The steps and their phases are those of ``ckptfmt.integrations.step_hooks``: ``data``,
    ``forward_backward`` and ``optimizer``, gradient accumulation's micro-batches in one step
    (Accelerate steps the optimizer only when gradients sync). Scalars of the loop's own go in with
    ``timing.timer.metrics``.
    """

    def __init__(self, accelerator: Accelerator):
        if not accelerator._models or not accelerator._optimizers:
            raise ValueError("StepTiming(accelerator) comes after accelerator.prepare(model, optimizer, ...)")
        super().__init__([accelerator.unwrap_model(model) for model in accelerator._models],
                         [_torch_optimizer(optimizer) for optimizer in accelerator._optimizers])
        _TIMINGS[accelerator] = self


# -- what the checkpoint holds -------------------------------------------------------------------


def _training_state(accelerator: Accelerator) -> dict[str, Any]:
    """Every prepared object's state under Accelerate's own names (``model_0``, ``optimizer_0``, ...)."""
    state: dict[str, Any] = {}
    for index, model in enumerate(accelerator._models):
        state[f"model_{index}"] = get_model_state_dict(model)
    for index, optimizer in enumerate(accelerator._optimizers):
        owner = _owner(accelerator, optimizer)
        inner = _torch_optimizer(optimizer)
        state[f"optimizer_{index}"] = (get_optimizer_state_dict(owner, inner) if owner is not None
                                       else inner.state_dict())
    for index, scheduler in enumerate(accelerator._schedulers):
        state[f"scheduler_{index}"] = scheduler.state_dict()
    for index, loader in enumerate(accelerator._dataloaders):
        state[f"dataloader_{index}"] = _loader_state(loader)
    state["scaler"] = accelerator.scaler.state_dict() if accelerator.scaler is not None else None
    for index, obj in enumerate(accelerator._custom_objects):
        state[f"custom_{index}"] = obj.state_dict()
    state["accelerate_step"] = accelerator.step
    return state


def _in_place_states(accelerator: Accelerator) -> dict[str, Any]:
    """The states loaded in place (models, and optimizers by parameter name): this run's own, with the
    tensors a load fills (torch creates an optimizer's state tensors for it)."""
    states: dict[str, Any] = {}
    for index, model in enumerate(accelerator._models):
        states[f"model_{index}"] = get_model_state_dict(model)
    for index, optimizer in enumerate(accelerator._optimizers):
        owner = _owner(accelerator, optimizer)
        if owner is not None:
            states[f"optimizer_{index}"] = get_optimizer_state_dict(owner, _torch_optimizer(optimizer))
    return states


def _entries_by_value(accelerator: Accelerator, in_place: dict[str, Any]) -> list[str]:
    """The checkpoint's entries this run loads as values (all but those filled in place)."""
    names = [f"optimizer_{index}" for index in range(len(accelerator._optimizers))
             if f"optimizer_{index}" not in in_place]
    names += [f"scheduler_{index}" for index in range(len(accelerator._schedulers))]
    names += [f"dataloader_{index}" for index in range(len(accelerator._dataloaders))]
    names += [f"custom_{index}" for index in range(len(accelerator._custom_objects))]
    return [*names, "accelerate_step"]


def _restore_rest(accelerator: Accelerator, rest: dict[str, Any], resharded: set[str]) -> None:
    for index, scheduler in enumerate(accelerator._schedulers):
        scheduler.load_state_dict(rest[f"scheduler_{index}"])
    for index, loader in enumerate(accelerator._dataloaders):
        _restore_loader(loader, rest[f"dataloader_{index}"], within_epoch=f"dataloader_{index}" not in resharded)
    if accelerator.scaler is not None and rest.get("scaler") is not None:
        accelerator.scaler.load_state_dict(rest["scaler"])
    for index, obj in enumerate(accelerator._custom_objects):
        obj.load_state_dict(rest[f"custom_{index}"])
    accelerator.step = rest["accelerate_step"]
    timing = _TIMINGS.get(accelerator)
    if timing is not None and isinstance(rest.get("step_timing"), dict):
        timing.steps_started = rest["step_timing"]["steps_started"]


def _loader_names(state: dict[str, Any]) -> list[str]:
    """The parts of ``_training_state`` that are data loaders' positions."""
    return [name for name in state if name.startswith("dataloader_")]


def _loader_state(loader: Any) -> dict[str, Any]:
    """A prepared data loader's position: its epoch (``iteration``, which seeds a seedable sampler's
    order), the sampler's seed, and a stateful loader's state dict (the position within the epoch).
    Accelerate's own save_state keeps none of the first two: after its load, a seedable sampler
    starts again from the first epoch's order."""
    state: dict[str, Any] = {}
    if hasattr(loader, "iteration"):
        # In an epoch whose last batch was handed out, the next epoch is the one to resume in.
        iterating = loader in loader.gradient_state.dataloader_references
        state["iteration"] = loader.iteration + (1 if iterating and loader.end_of_dataloader else 0)
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    if sampler is not None and hasattr(sampler, "initial_seed"):
        state["sampler_seed"] = sampler.initial_seed
    if getattr(loader, "use_stateful_dataloader", False):
        state["state_dict"] = loader.state_dict()
    return state


def _loader_shape(accelerator: Accelerator, loader: Any) -> dict[str, Any]:
    """What a loader's position depends on besides itself: the processes sharing each global batch, the
    global batch's size, and whether the position is inside an epoch (a batch of it handed out, not
    the last)."""
    iterating = loader in loader.gradient_state.dataloader_references if hasattr(loader, "gradient_state") \
        else False
    return {"num_replicas": accelerator.num_processes,
            "total_batch_size": getattr(loader, "total_batch_size", None) or getattr(loader, "batch_size", None),
            "within_epoch": bool(iterating and not getattr(loader, "end_of_dataloader", False))}


def _loaders_at_another_shape(accelerator: Accelerator, rest: dict[str, Any], topology: Any, url: str) -> set[str]:
    """The loaders whose checkpoint was taken at another world size or global batch size: at an epoch's
    end they go on with the next epoch's order, which Accelerate's seedable sampler draws whatever the
    world size (each global batch cut into the ranks' batches as before); inside an epoch each rank's
    position counts its own batches, which mean other samples now: refused, the field named."""
    shapes = _dict(rest.get(LOADERS_KEY))
    then_world = topology.get("world_size") if isinstance(topology, dict) else None
    changed = set()
    for index, loader in enumerate(accelerator._dataloaders):
        name = f"dataloader_{index}"
        now = _loader_shape(accelerator, loader)
        # a checkpoint from before shapes were stored: its world size, and the global batch taken as unchanged
        stored = {"num_replicas": then_world, "total_batch_size": now["total_batch_size"],
                  **_dict(shapes.get(name))}
        differences = [f"{field} was {stored[field]}, is {now[field]}" for field in ("num_replicas", "total_batch_size")
                       if stored[field] != now[field]]
        if not differences:
            continue
        state = _dict(rest.get(name))
        # (a stateful loader's position may be inside an epoch where the checkpoint does not say)
        if stored.get("within_epoch", "state_dict" in state):
            raise CheckpointError(
                f"{url}: {name}'s data position is inside epoch {state.get('iteration', '?')} and cannot be "
                f"continued by this run: {', '.join(differences)} (each rank's loader counts its own batches, "
                f"which are other samples at another shape); resume with the shape that saved it, or from a "
                f"checkpoint at an epoch's end")
        changed.add(name)
    return changed


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _restore_loader(loader: Any, state: dict[str, Any], *, within_epoch: bool = True) -> None:
    """``within_epoch`` False: the epoch (and seed) only, the position inside an epoch left at its start (a
    loader resumed at an epoch's end with another world size)."""
    if "iteration" in state and hasattr(loader, "set_epoch"):
        loader.set_epoch(state["iteration"])
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    if "sampler_seed" in state and sampler is not None and hasattr(sampler, "initial_seed"):
        sampler.initial_seed = state["sampler_seed"]
    if within_epoch and "state_dict" in state and getattr(loader, "use_stateful_dataloader", False):
        loader.load_state_dict(state["state_dict"])
        if "dl_state_dict" in vars(loader):
            # Accelerate's loader answers state_dict() from a copy it refreshes only as batches go out: after
            # a load it would still give the position before it (a save made at once would store that).
            loader.dl_state_dict = copy.deepcopy(state["state_dict"])


def _owner(accelerator: Accelerator, optimizer: Any) -> torch.nn.Module | None:
    """The prepared model holding every parameter the optimizer steps, if one does (then its state is
    saved by parameter name, and sharded states load in place); else None."""
    parameters = {id(p) for group in _torch_optimizer(optimizer).param_groups for p in group["params"]}
    for model in accelerator._models:
        if parameters <= {id(p) for p in model.parameters()}:
            return model
    return None


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


def _refuse_engines(accelerator: Accelerator) -> None:
    engine = _ENGINES.get(accelerator.distributed_type)
    if engine is not None:
        raise CheckpointError(f"ckptfmt's Accelerate integration does not save {engine} runs: their engine "
                              "saves its own state (keep accelerator.save_state, and `ckptfmt import` its folder)")


# -- automatic checkpoint naming ------------------------------------------------------------------


def _automatic_repo(accelerator: Accelerator) -> str:
    return f"{os.fspath(accelerator.project_dir).rstrip('/')}/checkpoints"


def _automatic_names(repo_url: str, storage_options: dict | None) -> list[tuple[int, str]]:
    """``(N, name)`` of the repository's ``checkpoint_N`` checkpoints, oldest first."""
    try:
        repo = Repository.open(repo_url, storage_options)
    except CheckpointNotFoundError:
        return []
    found = []
    for record in repo.commits():
        match = _AUTOMATIC_NAME.fullmatch(record.name)
        if match:
            found.append((int(match.group(1)), record.name))
    return sorted(found)


def _newest(repo_url: str, storage_options: dict | None) -> str:
    names = _automatic_names(repo_url, storage_options)
    if not names:
        raise CheckpointNotFoundError(f"{repo_url}: no checkpoint_N checkpoint to load")
    return f"{repo_url}/{names[-1][1]}"


def _keep_newest(repo_url: str, limit: int, storage_options: dict | None) -> None:
    """Remove the oldest ``checkpoint_N`` beyond ``limit``, then the chunks nothing kept uses."""
    names = _automatic_names(repo_url, storage_options)
    doomed = [name for _, name in names[: max(0, len(names) - limit)]]
    if doomed:
        repo = Repository.open(repo_url, storage_options)
        remove(repo, doomed)
        collect(repo)


__all__ = ["StepTiming", "load_state", "save_state"]
