"""torchtitan: a checkpoint manager that saves and loads through ckptfmt.

torchtitan picks its checkpointer from the trainer's config; this one is chosen by its Config::

    from ckptfmt.integrations.torchtitan import CkptfmtCheckpointManager

    checkpoint = CkptfmtCheckpointManager.Config(enable=True, folder="checkpoint", interval=500)

Every option of torchtitan's own (DCP) manager keeps its meaning: ``interval``,
``enable_first_step_checkpoint``, ``keep_latest_k``, ``load_step``, ``exclude_from_loading``,
``last_save_model_only`` with ``export_dtype``, ``initial_load_path`` (a ckptfmt checkpoint, or a
DCP folder written by torchtitan's manager), ``initial_load_model_only``, ``load_only`` and
``async_mode``. The folder is a ckptfmt repository (local, ``s3://`` or any fsspec URL, with
``storage_options``); checkpoints are named ``step-N`` as torchtitan names them. Each save is one
collective checkpoint holding what torchtitan's manager saves (the model's and optimizer's
sharded states, the learning-rate schedulers, every rank's data loader position, the train state
and any other Stateful the trainer registered) plus every rank's RNG states, which a load
restores, every rank's step timing and signatures, taken from hooks on the model parts and the
optimizers (each step's output signed by its gradients' norm: the trainer computes its loss where
no hook sees it), and the trainer's settings that shape a step (``job_config/hyperparameters``:
its ``training``, ``lr_scheduler``, ``optimizer`` and ``debug`` seed), so that ``ckptfmt compare``
and ``certify`` can name one that changed. A load puts on record what it restored, every
registered part (one left out by ``exclude_from_loading`` is on record as not restored).
Hugging Face safetensors (``initial_load_in_hf``, ``last_save_in_hf``) are refused: use
torchtitan's own manager for those, or ``ckptfmt export``.
"""

from __future__ import annotations

import posixpath
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError
from ckptfmt.format.per_rank import PerRank
from ckptfmt.format.plain_values import plain_tree
from ckptfmt.integrations.step_hooks import HookedStepTimer
from ckptfmt.lifecycle.manager import CheckpointManager
from ckptfmt.loading.load_into import load_into
from ckptfmt.loading.loaded_fingerprints import remember_load
from ckptfmt.loading.reader import open as open_checkpoint
from ckptfmt.loading.reader import restore_rng
from ckptfmt.loading.resume_check import record_resume

#: The user metadata key that marks a model-only checkpoint (torchtitan's last save).
MODEL_ONLY = "torchtitan_model_only"
#: Where a checkpoint holds the trainer's step-shaping settings (``job_config/hyperparameters``).
SETTINGS_KEY = "job_config"
#: The trainer's settings that change what a training step computes, by its config's section.
_STEP_SETTINGS = {
    "training": ("local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps", "dtype",
                 "mixed_precision_param", "mixed_precision_reduce"),
    "lr_scheduler": ("warmup_steps", "total_steps", "decay_ratio", "decay_type", "min_lr_factor"),
    "debug": ("seed", "deterministic"),
}
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


class CkptfmtCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, saved through ckptfmt (see the module's docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """``async``: the save is staged on the training thread and written in the background;
        ``async_with_pinned_mem`` stages into pinned host buffers (ckptfmt's asynchronous save
        does both: its staging ends before ``save`` returns)."""

        storage_options: dict[str, Any] | None = None
        """fsspec options for the folder and ``initial_load_path`` (an S3 endpoint, credentials)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in ASYNC_MODES:
                raise ValueError(f"Invalid async_mode: {self.async_mode} (one of {', '.join(ASYNC_MODES)})")
            for option in ("initial_load_in_hf", "last_save_in_hf"):
                if getattr(self, option):
                    raise ValueError(f"{option} is not supported by CkptfmtCheckpointManager: use torchtitan's "
                                     f"CheckpointManager for Hugging Face safetensors, or `ckptfmt export`")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Future | None = None
        self.config = config
        self.folder = _join(base_folder, config.folder)
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader,
                            LR_SCHEDULER: lr_schedulers})
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.manager = CheckpointManager(self.folder, keep_last=config.keep_latest_k or None,
                                         async_save=config.async_mode != "disabled", name_format="step-{step}",
                                         storage_options=config.storage_options)
        #: Per-rank step timing, saved with every checkpoint.
        self.timing = HookedStepTimer(model_parts, [optimizers], step_number=self._step_number)

    def __del__(self) -> None:
        self.close()

    # -- saving ------------------------------------------------------------------------------
    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        """torchtitan's rule: never with ``load_only``; step 1 with ``enable_first_step_checkpoint``;
        the last step; every ``interval`` steps."""
        if self.config.load_only:
            return False
        return ((curr_step == 1 and self.config.enable_first_step_checkpoint) or last_step
                or curr_step % self.config.interval == 0)

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        model_only = last_step and self.config.last_save_model_only
        state = self._model_for_export() if model_only else self._state_to_save()
        self.manager.save(curr_step, state, timer=self.timing.timer, force=True,
                          metadata={MODEL_ONLY: True} if model_only else None)
        if last_step:  # the run ends: its last checkpoint is complete when save returns
            self.manager.wait()
        elif self.manager.pending_save is not None:
            self.save_future = self.manager.pending_save
        return True

    def _state_to_save(self) -> dict[str, Any]:
        """Every registered Stateful's state under torchtitan's keys; the data loader's per rank."""
        state: dict[str, Any] = {}
        for key, stateful in self.states.items():
            if stateful is not None:
                value = stateful.state_dict()
                state[key] = PerRank(value) if key == DATALOADER else value
        settings = step_settings(getattr(self.states.get(TRAIN_STATE), "config", None))
        if settings:
            state[SETTINGS_KEY] = {"hyperparameters": settings}
        return state

    def _model_for_export(self) -> dict[str, Any]:
        """The model alone, floating-point tensors in ``export_dtype`` (torchtitan's last save)."""
        model = self.states[MODEL].state_dict()
        return {MODEL: {key: value.to(self.export_dtype)
                        if isinstance(value, torch.Tensor) and value.is_floating_point() else value
                        for key, value in model.items()}}

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: ckptfmt's asynchronous save has staged the state when ``save`` returns."""

    def _wait_for_saving(self) -> None:
        self.manager.wait()
        self.save_future = None

    def _close(self) -> None:
        if hasattr(self, "manager"):
            self.timing.remove()
            self.manager.close()

    # -- loading -----------------------------------------------------------------------------
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load ``step`` (-1: the newest) from the folder, or else ``initial_load_path``; False on a
        fresh start. Step 0 (a seed checkpoint) and the last save's model-only checkpoint load the
        model alone."""
        steps = self.manager.steps()
        if step != -1 and step not in steps:
            raise CheckpointNotFoundError(f"checkpoint.load_step={step}: no step-{step} in {self.folder} "
                                          f"(it holds {', '.join(map(str, steps)) or 'none'})")
        if step == -1 and steps:
            step = steps[-1]
        if step != -1:
            self._load_checkpoint(f"{self.folder}/step-{step}", model_only=step == 0)
        elif self.config.initial_load_path:
            self._load_initial(self.config.initial_load_path, model_only=self.config.initial_load_model_only)
        else:
            return False
        return True

    def _load_checkpoint(self, url: str, *, model_only: bool) -> None:
        with open_checkpoint(url, storage_options=self.config.storage_options) as reader:
            model_only = model_only or bool(reader.metadata["user"].get(MODEL_ONLY))
            keys = self._keys_to_load(model_only)
            if DATALOADER in keys:  # before anything is loaded
                self._check_loader_world_size(reader)
            template = {key: self.states[key].state_dict() for key in keys}
            load_into(reader, template, strict=True, rank=_rank(), within=keys)
            remember_load(reader.commit.manifest_hash, reader.manifest, template)
        for key in keys:
            self.states[key].load_state_dict(template[key])
        parts = keys if model_only else [key for key, stateful in self.states.items() if stateful is not None]
        record_resume(url, {key: self.states[key] for key in parts}, storage_options=self.config.storage_options)
        if not model_only:
            self._restore_rng_at_first_step(url)

    def _check_loader_world_size(self, reader: Any) -> None:
        """torchtitan keeps one data loader position per data-parallel rank and cannot reshard them: a
        resume at another data-parallel world size is refused here, naming it, before anything loads."""
        tree = plain_tree(reader.manifest)
        stored = tree.get(DATALOADER) if isinstance(tree, dict) else None
        ranks = stored.values() if isinstance(stored, dict) else ()
        then = next((value.get("world_size") for value in ranks if isinstance(value, dict)), None)
        now = getattr(self.states[DATALOADER], "dp_world_size", None)
        if type(then) is int and type(now) is int and then != now:
            raise CheckpointError(
                f"{reader.url}: the data loader's position cannot be resumed: its data-parallel world_size was "
                f"{then}, is {now} (torchtitan keeps one position per data-parallel rank and does not reshard "
                f"them); load with checkpoint.exclude_from_loading=['dataloader'] to start the data again")

    def _restore_rng_at_first_step(self, url: str) -> None:
        """Restore this rank's RNG states as the first training step after the load begins, before its
        signature digests them, so that what the loop draws before it (a DataLoader iterator takes a
        seed from the generator) does not shift them: the run then continues as the run that saved did."""
        self.timing.at_next_step(
            lambda: restore_rng(url, rank=_rank(), storage_options=self.config.storage_options))

    def _keys_to_load(self, model_only: bool) -> list[str]:
        if model_only:
            return [MODEL]
        for key in self.config.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"{key} not found in state_dict.")
        return [key for key, stateful in self.states.items()
                if stateful is not None and key not in self.config.exclude_from_loading]

    def _load_initial(self, path: str, *, model_only: bool) -> None:
        """``initial_load_path``: a ckptfmt checkpoint (``REPO/NAME``), or a DCP folder written by
        torchtitan's own manager (its model's keys flattened into the top level)."""
        filesystem, root = fsspec.core.url_to_fs(path, **(self.config.storage_options or {}))
        if not filesystem.exists(posixpath.join(root, ".metadata")):
            self._load_checkpoint(path, model_only=model_only)
            return
        keys = self._keys_to_load(model_only)
        flat = {key: self.states[key].state_dict() for key in keys if key != MODEL}
        flat.update(self.states[MODEL].state_dict())
        dcp.load(flat, checkpoint_id=path)
        self.states[MODEL].load_state_dict(flat)
        for key in keys:
            if key != MODEL:
                self.states[key].load_state_dict(flat[key])

    def _step_number(self) -> int:
        """The step a starting forward belongs to: torchtitan counts steps from 1 in its train
        state, which it advances before the step runs."""
        train_state = self.states.get(TRAIN_STATE)
        return int(train_state.step) if train_state is not None else self.timing.steps_started + 1


def step_settings(config: Any) -> dict[str, Any]:
    """The trainer's settings that change what a step computes, as plain values, from its config (the
    ``Trainer.Config`` of the Trainer registered as ``train_state``); empty where there is none."""
    if config is None or not hasattr(config, "training"):
        return {}
    settings: dict[str, Any] = {}
    for section, names in _STEP_SETTINGS.items():
        values = getattr(config, section, None)
        for name in names:
            if hasattr(values, name):
                settings[f"{section}.{name}"] = _plain(getattr(values, name))
    for index, group in enumerate(getattr(getattr(config, "optimizer", None), "param_groups", None) or []):
        settings[f"optimizer.{index}.name"] = _plain(getattr(group, "optimizer_name", None))
        for name, value in sorted((getattr(group, "optimizer_kwargs", None) or {}).items()):
            settings[f"optimizer.{index}.{name}"] = _plain(value)
    return settings


def _plain(value: Any) -> Any:
    """A setting as a plain value: numbers, text, flags and None as they are, others as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(item, (bool, int, float, str)) for item in value):
        return list(value)
    return str(value)


def _join(base_folder: str, folder: str) -> str:
    """torchtitan's folder rule: ``folder`` under ``base_folder`` unless it is absolute or a URL."""
    if not base_folder or folder.startswith("/") or "://" in folder:
        return folder
    return f"{base_folder.rstrip('/')}/{folder}"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
