"""The Hugging Face Trainer: its checkpoints saved through ckptfmt, and every rank's step timing for free.

    saving = CkptfmtCallback("s3://bucket/run")
    trainer = Trainer(model, args, train_dataset=..., callbacks=[saving])
    trainer.train(resume_from_checkpoint=saving.resume_folder(args))   # None on a fresh start

Every save the Trainer decides on (``save_strategy``, ``save_steps``) becomes one
ckptfmt checkpoint through a ``CheckpointManager``, holding what the Trainer's
own ``checkpoint-N/`` folder holds: the model, optimizer, scheduler and grad
scaler states and the trainer state (every rank's RNG states are in each
checkpoint's run metadata). It is made at the moment the Trainer would save
(after the step's evaluation, when one is due), collectively under
torch.distributed; the Trainer then writes no folder of its own, unless
``keep_hf_folders=True``. ``save_total_limit`` and ``load_best_model_at_end``
become the manager's retention (the last N, and the best by
``metric_for_best_model``), and at the end of training the best checkpoint's
weights are loaded into the model, as the Trainer does.

``resume_folder`` writes the newest checkpoint (or the one of ``step``) as a
``checkpoint-N/`` folder that ``train(resume_from_checkpoint=...)`` reads, so
the Trainer's own resume code restores every state and skips the batches
already seen exactly as it always does.

Every step is timed on every rank (``data``, ``forward_backward``,
``optimizer``; epoch and global step), and each checkpoint holds every
rank's steps (``ckptfmt stragglers``, ``ckptfmt report``).

Each checkpoint records the training loader's data position with its
sampler's contract (``data_position``, as ``ckptfmt.integrations.sampler``
describes it), and a resume records the position the Trainer will skip to:
a resume with ``ignore_data_skip``, or on another world size (the Trainer
skips the same number of batches per rank, of another global batch), is on
the resume's record.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import random
import shutil
import time
import warnings
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from ckptfmt.errors import CheckpointError, CheckpointWarning, quoted
from ckptfmt.format.plain_values import plain_tree
from ckptfmt.integrations.sampler import check_position, fingerprint
from ckptfmt.lifecycle.manager import CheckpointManager
from ckptfmt.loading.load_into import load_into
from ckptfmt.loading.reader import open as open_checkpoint
from ckptfmt.loading.resume_check import record_resume
from ckptfmt.metadata.rng import decode_states
from ckptfmt.metadata.step_timer import StepTimer
from ckptfmt.saving.options import SaveOptions

#: The manager's own keyword arguments (the rest are save options, checked when the callback is made).
_MANAGER_KEYWORDS = frozenset(inspect.signature(CheckpointManager).parameters) - {"save_options"}
#: What the checkpoint's entries are named, as the Trainer names its files.
_ENTRIES = ("model", "optimizer", "scheduler", "scaler", "trainer_state")
#: The training log's values kept with each timed step.
_LOGGED = ("loss", "grad_norm", "learning_rate")


class CkptfmtCallback(TrainerCallback):
    """Saves the Trainer's checkpoints as ckptfmt checkpoints of ``repo`` (see the module docstring).

    ``keep_hf_folders``: the Trainer still writes its ``checkpoint-N/`` folders beside.
    Other keywords are ``CheckpointManager``'s (``keep_last``, ``keep_every``, ``tiers``, ``async_save``,
    ``compression``, ...); unset retention follows ``save_total_limit`` and ``load_best_model_at_end``.
    """

    def __init__(self, repo: str | os.PathLike, *, keep_hf_folders: bool = False, **manager_options: Any):
        save_options = {k: v for k, v in manager_options.items() if k not in _MANAGER_KEYWORDS}
        SaveOptions.from_keywords("CkptfmtCallback", save_options)  # a misspelt option fails now
        self.repo = os.fspath(repo)
        self.keep_hf_folders = keep_hf_folders
        self.manager_options = manager_options
        self.manager: CheckpointManager | None = None
        self.timer = StepTimer()
        self._due = False
        self._last_saved: int | None = None
        self._since: int | None = None
        self._hooks: list | None = None
        self._resumed_from: tuple[str, dict | None] | None = None
        #: The current step's loss: its micro-batches' losses as the model returned them, summed.
        self._step_loss: Any = None

    # -- saves ---------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if args.fsdp or args.deepspeed:
            raise CheckpointError("CkptfmtCallback saves plain and DDP Trainer runs; this one is sharded by "
                                  f"{'FSDP' if args.fsdp else 'DeepSpeed'}: keep the Trainer's own saving "
                                  "(and `ckptfmt import` its folders)")
        if self.manager is None:
            self.manager = CheckpointManager(self.repo, **self._retention(args), **self.manager_options)
        self._since = time.perf_counter_ns()
        model = kwargs.get("model")
        if self._resumed_from is not None and model is not None:  # the Trainer has restored its objects by now
            (url, storage_options), self._resumed_from = self._resumed_from, None
            live = {"model": model, "optimizer": kwargs.get("optimizer"), "scheduler": kwargs.get("lr_scheduler")}
            with open_checkpoint(url, storage_options=storage_options) as reader:
                tree = plain_tree(reader.manifest)
                stored = tree.get("data_position") if isinstance(tree, dict) else None
                position = data_position(args, kwargs.get("train_dataloader"), state.global_step, resuming=True)
                record_resume(reader, {part: obj for part, obj in live.items() if obj is not None},
                              checked=[check_position(stored, position)] if stored is not None else [])
        if model is not None and self._hooks is None:  # each step's signature: its batch and its loss
            self._hooks = [model.register_forward_pre_hook(self._batch, with_kwargs=True),
                           model.register_forward_hook(self._loss)]

    def on_step_end(self, args, state, control, **kwargs):
        if self.timer.in_step:
            self.timer.metrics(epoch=state.epoch or 0.0)
            if self._step_loss is not None:
                self.timer.metrics(loss=self._step_loss)
            self._step_loss = None
            self.timer.end_step()
        self._since = time.perf_counter_ns()
        return self._take_over(args, state, control, kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        return self._take_over(args, state, control, kwargs)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        """After the step's evaluation: the save that waited for it, or a new best under ``save_strategy="best"``."""
        if str(args.save_strategy) in ("best", "SaveStrategy.BEST") and _new_best(args, state, metrics) is not None:
            self._due = True
        if self._due:
            self._save(args, state, control, kwargs, metrics)
        self._since = time.perf_counter_ns()

    def on_save(self, args, state, control, **kwargs):
        """The Trainer wrote a folder (``save_strategy="best"`` cannot be taken over): it goes."""
        if not self.keep_hf_folders and args.should_save:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if os.path.isdir(folder):
                shutil.rmtree(folder, ignore_errors=True)

    def on_train_end(self, args, state, control, **kwargs):
        """Wait for the saves in flight; with ``load_best_model_at_end``, the best weights into the model."""
        if self.manager is None:
            return
        self.manager.wait()
        best = state.best_global_step
        if args.load_best_model_at_end and not self.keep_hf_folders and best:
            if best in self.manager.steps():
                url = f"{self.manager.tiers[0].url}/{self.manager.name_format.format(step=best)}"
                with open_checkpoint(url, storage_options=self.manager.tiers[0].storage_options) as reader:
                    load_into(reader, {"model": kwargs["model"].state_dict()}, strict=True, rank=0, within=["model"])
            else:
                warnings.warn(CheckpointWarning(f"{self.repo}: the best checkpoint (step {best}) is no longer kept "
                                                "(retention without keep_best); the model keeps its last weights"),
                              stacklevel=2)
        self.manager.close()
        self.manager = None
        for hook in self._hooks or []:
            hook.remove()
        self._hooks = None

    def _take_over(self, args, state, control, kwargs: dict):
        """The Trainer decided to save at this point: save where it would (after the step's log and
        evaluation, when due), and keep it from writing its own folder."""
        if not control.should_save:
            return control
        self._due = True
        if not self.keep_hf_folders:
            control.should_save = False
        if not (control.should_evaluate or control.should_log):
            self._save(args, state, control, kwargs, None)
        return control

    def _save(self, args, state, control, kwargs: dict, metrics: dict | None) -> None:
        self._due = False
        if self.manager is None or self._last_saved == state.global_step:
            return
        model, optimizer, scheduler = kwargs.get("model"), kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        checkpoint: dict[str, Any] = {"model": model.state_dict() if model is not None else {},
                                      "trainer_state": _trainer_state(args, state, control, metrics,
                                                                      self.keep_hf_folders),
                                      "training_args": {"hyperparameters": training_hyperparameters(args)}}
        position = data_position(args, kwargs.get("train_dataloader"), state.global_step)
        if position is not None:
            checkpoint["data_position"] = position
        if not args.save_only_model:
            checkpoint["optimizer"] = optimizer.state_dict() if optimizer is not None else None
            checkpoint["scheduler"] = scheduler.state_dict() if scheduler is not None else None
            scaler = getattr(optimizer, "scaler", None)  # Accelerate's AcceleratedOptimizer holds it
            checkpoint["scaler"] = scaler.state_dict() if scaler is not None else None
        numbers = {k: float(v) for k, v in (metrics or {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.manager.save(state.global_step, checkpoint, metrics=numbers or None, timer=self.timer, force=True)
        self._last_saved = state.global_step

    def _retention(self, args) -> dict:
        """The manager's retention from the Trainer's arguments, where the caller set none."""
        if set(self.manager_options) & {"keep_last", "keep_every", "keep_best", "keep_within", "tiers"}:
            return {}
        retention: dict[str, Any] = {}
        if args.save_total_limit:
            retention["keep_last"] = args.save_total_limit
        if args.load_best_model_at_end and args.metric_for_best_model:
            metric = args.metric_for_best_model
            retention["keep_best"] = (metric if metric.startswith("eval_") else f"eval_{metric}",
                                      "max" if args.greater_is_better else "min", 1)
        return retention

    # -- timing --------------------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        """Step N is the N-th optimizer step, as the Trainer's logs and folders number them."""
        if not self.timer.in_step:
            self.timer.start_step(state.global_step + 1, since_ns=self._since, phase="data")
            self.timer.mark("forward_backward")

    def on_log(self, args, state, control, logs=None, **kwargs):
        """The training log's loss, gradient norm and learning rate go with the step just ended; then
        the save that waited for them (a checkpoint holds its last step's loss, as the Trainer's does)."""
        values = {("logged_loss" if k == "loss" else k): v for k, v in (logs or {}).items()
                  if k in _LOGGED and isinstance(v, (int, float))}
        if values and not self.timer.in_step and self.timer.pending:
            self.timer.metrics(**values)
        if self._due and not control.should_evaluate:
            self._save(args, state, control, kwargs, None)

    def _batch(self, module, args, kwargs) -> None:
        if module.training and self.timer.in_step:
            self.timer.batch_tensors((args, kwargs))

    def _loss(self, module, args, output) -> None:
        """The loss the model computed (its output's ``loss``), exact: the step's is its micro-batches'
        sum, kept on its device until the step ends."""
        loss = getattr(output, "loss", None) if not isinstance(output, dict) else output.get("loss")
        if module.training and self.timer.in_step and loss is not None and getattr(loss, "numel", lambda: 0)() == 1:
            loss = loss.detach()
            self._step_loss = loss if self._step_loss is None else self._step_loss + loss

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.timer.in_step:
            self.timer.mark("optimizer")

    # -- resume --------------------------------------------------------------------------------------
    def resume_folder(self, args, step: int | None = None) -> str | None:
        """Write the newest checkpoint (or step ``step``'s) as a ``checkpoint-N/`` folder for
        ``trainer.train(resume_from_checkpoint=...)``; None when there is none (a fresh start).

        Under torch.distributed, every rank calls it: the process that writes the Trainer's folders
        (``args.should_save``) writes it, the others wait and get the path.
        """
        manager = self.manager or CheckpointManager(self.repo, **self.manager_options)
        steps = manager.steps()
        if step is not None and step not in steps:
            raise CheckpointError(f"{self.repo}: no checkpoint of step {step} (there are {steps})")
        chosen = step if step is not None else (max(steps) if steps else None)
        if chosen is None:
            if manager is not self.manager:
                manager.close()
            return None
        folder = os.path.join(args.output_dir, "ckptfmt-resume", f"checkpoint-{chosen}")
        url = f"{manager.tiers[0].url}/{manager.name_format.format(step=chosen)}"
        #: The checkpoint the Trainer resumes from: what it restored goes on record at the start of training.
        self._resumed_from = (url, manager.tiers[0].storage_options)
        if args.should_save:  # the process that writes the Trainer's folders (one per node if save_on_each_node)
            _materialise(url, folder, manager.tiers[0].storage_options)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if manager is not self.manager:
            manager.close()
        return folder


#: The ``TrainingArguments`` that change what a training step computes, recorded with each checkpoint
#: (``training_args/hyperparameters``) so that ``ckptfmt compare`` and ``certify`` can name them.
_STEP_ARGUMENTS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
                   "gradient_accumulation_steps", "per_device_train_batch_size", "lr_scheduler_type",
                   "warmup_steps", "warmup_ratio", "optim", "label_smoothing_factor", "bf16", "fp16", "seed",
                   "data_seed", "ignore_data_skip")


def training_hyperparameters(args) -> dict[str, Any]:
    """The step-shaping ``TrainingArguments`` as plain values (enums as their values)."""
    found = {}
    for name in _STEP_ARGUMENTS:
        value = getattr(args, name, None)
        value = getattr(value, "value", value)
        found[name] = value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
    return found


def data_position(args, loader: Any, global_step: int, *, resuming: bool = False) -> dict[str, Any] | None:
    """The Trainer's data position after ``global_step`` optimizer steps, as its resume computes it
    (whole epochs, then the batches of this epoch each rank skips: none with ``ignore_data_skip``),
    in samples of the job, with the sampler's contract; None for a loader of no sized dataset.
    ``resuming``: the position a resume takes (the one a save records counts every batch)."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__len__") or not hasattr(loader, "__len__"):
        return None
    per_epoch = max(len(loader) // args.gradient_accumulation_steps, 1)
    epoch, steps = divmod(global_step, per_epoch)
    batches = 0 if resuming and args.ignore_data_skip else steps * args.gradient_accumulation_steps
    return {"epoch": epoch, "consumed": batches * args.per_device_train_batch_size * args.world_size,
            "seed": args.data_seed if args.data_seed is not None else args.seed, "shuffle": True,
            "dataset_length": len(dataset), "dataset_fingerprint": fingerprint(dataset),
            "num_replicas": args.world_size, "batch_size": args.per_device_train_batch_size,
            "workers": args.dataloader_num_workers, "resumable": False}


def _trainer_state(args, state, control, metrics: dict | None, hf_folders: bool) -> dict:
    """``trainer_state.json`` as the Trainer would write it now.

    The save is made before the Trainer weighs the step's evaluation, so its
    verdict (best metric and step) is applied here; the process flags are the
    writing rank 0's, as in the Trainer's file. ``best_model_checkpoint`` names
    a folder only where the Trainer writes folders (``hf_folders``). Stateful
    callbacks other than the control (``EarlyStoppingCallback``) are as of the
    Trainer's last own save: a callback cannot reach the others.
    """
    record = json.loads(json.dumps(dataclasses.asdict(state)))
    record.update(is_local_process_zero=True, is_world_process_zero=True)
    control_state = control.state()
    control_state["args"]["should_save"] = True  # as the Trainer's own save sees it
    record.setdefault("stateful_callbacks", {})["TrainerControl"] = control_state
    best = _new_best(args, state, metrics)
    if best is not None:
        record.update(best_metric=best, best_global_step=state.global_step)
    elif metrics and args.metric_for_best_model and state.best_metric is None:
        record["best_metric"] = float("-inf") if args.greater_is_better else float("inf")
    if hf_folders and record["best_global_step"]:
        folder = os.path.join(args.output_dir, f"checkpoint-{record['best_global_step']}")
        if record["best_global_step"] == state.global_step or os.path.isdir(folder):
            record["best_model_checkpoint"] = folder
    return record


def _new_best(args, state, metrics: dict | None) -> float | None:
    """The value of ``metric_for_best_model`` in ``metrics`` if the Trainer is about to call it the new best."""
    metric = args.metric_for_best_model
    if not metric or not metrics:
        return None
    value = metrics.get(metric if metric.startswith("eval_") else f"eval_{metric}")
    if value is None:
        return None
    if args.greater_is_better:
        better = value > (state.best_metric if state.best_metric is not None else float("-inf"))
    else:
        better = value < (state.best_metric if state.best_metric is not None else float("inf"))
    return float(value) if better else None


def _materialise(url: str, folder: str, storage_options: dict | None) -> None:
    """The checkpoint ``url`` as the Trainer's ``checkpoint-N/`` folder (its file names and formats); its RNG
    states are all checked before a file is written."""
    with open_checkpoint(url, storage_options=storage_options) as reader:
        state = reader.load_state()
        rng_files = _trainer_rng_files(reader.metadata["rng"], url)
    os.makedirs(folder, exist_ok=True)
    torch.save(state["model"], os.path.join(folder, "pytorch_model.bin"))
    for entry, file in (("optimizer", "optimizer.pt"), ("scheduler", "scheduler.pt"), ("scaler", "scaler.pt")):
        if state.get(entry) is not None:
            torch.save(state[entry], os.path.join(folder, file))
    with open(os.path.join(folder, "trainer_state.json"), "w", encoding="utf-8") as f:
        json.dump(state["trainer_state"], f, indent=2, sort_keys=True)
    for name, states in rng_files.items():
        torch.save(states, os.path.join(folder, name))


def _trainer_rng_files(rng: list[dict], where: str) -> dict[str, dict]:
    """The Trainer's ``rng_state[_RANK].pth`` files of a checkpoint's RNG entries (spec 9.1: a rank's first
    entry is its state), each checked."""
    firsts: dict[int, dict] = {}
    for entry in rng:
        rank = entry.get("rank")
        if type(rank) is not int or rank < 0:  # it names a file: nothing but a rank may reach the path
            raise CheckpointError(f"{where}: an RNG state's rank must be an int >= 0, not {quoted(rank)}")
        firsts.setdefault(rank, entry)
    if len(firsts) == 1:
        return {"rng_state.pth": _trainer_rng(next(iter(firsts.values())), where)}
    return {f"rng_state_{rank}.pth": _trainer_rng(entry, where) for rank, entry in firsts.items()}


def _trainer_rng(entry: dict, where: str) -> dict:
    """A ckptfmt RNG entry (spec 9.1) as the Trainer's ``rng_state.pth`` holds it, each state tried on a
    generator of its own first: the Trainer sets the process's generators from it, and numpy checks
    neither its key nor its position."""
    rank = entry["rank"]
    for name in ("numpy", "python"):
        if not entry.get(name):
            raise CheckpointError(f"{where}: rank {rank}'s RNG state has no {name} state, which the Trainer "
                                  "restores on resume")
    try:
        decoded = decode_states(entry)
        assert decoded.python is not None and decoded.numpy is not None  # both present: checked above
        random.Random().setstate(decoded.python)
        np.random.RandomState().set_state(decoded.numpy)
        torch.Generator().set_state(decoded.torch_cpu)
    except (KeyError, TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: malformed RNG state of rank {rank} ({exc})") from None
    states: dict[str, Any] = {"python": decoded.python, "numpy": decoded.numpy, "cpu": decoded.torch_cpu}
    if decoded.cuda:
        states["cuda"] = decoded.cuda
    return states


__all__ = ["CkptfmtCallback"]
