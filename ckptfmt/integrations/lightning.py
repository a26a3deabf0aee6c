"""Lightning: its checkpoints saved through ckptfmt, and every rank's step timing for free.

    trainer = L.Trainer(
        plugins=[CkptfmtCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath="s3://bucket/run", save_top_k=3, monitor="val_loss"),
                   StepTimingCallback()])

``ModelCheckpoint``'s folder is a ckptfmt repository. Each path Lightning saves
(``DIR/epoch=1-step=200.ckpt``) is a checkpoint of that repository, named after
the path (``epoch_1-step_200``: ckptfmt names allow no ``=``), plus a small
*pointer* file at the very path, naming the checkpoint. Lightning's own file
operations (``exists`` for version counters, ``ls`` to find ``last.ckpt``,
``modified`` to pick the newest) then work unchanged on any filesystem, S3
included, and a path saved again (``last.ckpt``) is replaced atomically: the new
checkpoint commits first, then the pointer moves to it, then the old one is
removed. ``remove_checkpoint`` (``save_top_k``) removes the checkpoint, and the
chunks that no kept checkpoint uses go at once (garbage collection). Loading a
path that holds a torch.save file (a run that switched to ckptfmt) reads it as
Lightning's own ``TorchCheckpointIO`` does.

Lightning writes from rank 0 only; ``StepTimingCallback`` times every step on
every rank (data, forward_backward and optimizer phases, the batch index) and
gathers the ranks' steps when a checkpoint is prepared, so that each checkpoint
holds them all (``ckptfmt stragglers`` and ``ckptfmt report`` read them).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

from ckptfmt.distributed.steps import gather_steps
from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CorruptDataError, InvalidNameError
from ckptfmt.format import layout
from ckptfmt.format.limits import MAX_NAME_LENGTH
from ckptfmt.integrations.sampler import check_position, data_position, resumable
from ckptfmt.lifecycle.gc import collect, remove
from ckptfmt.loading.load_into import load_into
from ckptfmt.loading.reader import load, restore_rng
from ckptfmt.loading.reader import open as open_checkpoint
from ckptfmt.loading.resume_check import check_generators, record_resume
from ckptfmt.metadata.step_timer import DEFAULT_PROGRESS_INTERVAL_S, StepTimer
from ckptfmt.metadata.topology import current_rank
from ckptfmt.repository.pointers import POINTER_FORMAT, looks_like_pointer, pointed_name, read_small
from ckptfmt.repository.progress import bind_repository
from ckptfmt.repository.repository import Repository
from ckptfmt.saving.asynchronous import AsyncSaver
from ckptfmt.saving.options import SaveOptions
from ckptfmt.saving.save import save_with
from ckptfmt.storage.base import Storage
from ckptfmt.storage.factory import open_storage

#: Where ``StepTimingCallback`` leaves every rank's steps in the checkpoint dict for the plugin.
STEPS_KEY = "ckptfmt_gathered_steps"
#: Where it leaves each rank's own StepTimer for a collective save (``CkptfmtModelParallelStrategy``).
TIMER_KEY = "ckptfmt_step_timer"
#: Where it records the Trainer's settings that change what a step computes (``trainer_settings``).
SETTINGS_KEY = "trainer"
#: Where it records the training loader's data position and its sampler's contract (``data_position``).
DATA_KEY = "data_position"
#: Save options the plugin sets itself for each save.
_SET_PER_SAVE = frozenset({"step", "metadata", "storage_options", "coordinated", "gathered_steps"})
_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9._-]")


class CkptfmtCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through ckptfmt (see the module docstring).

    ``storage_options``: fsspec options of the repositories (S3 endpoint, credentials).
    ``async_save``: checkpoints are staged into reused host buffers on the training thread
    (no clone) and written on a background thread; errors surface at the next call.
    ``collect_garbage``: reclaim the chunks of removed checkpoints at once (in the background).
    Other keywords (``compression``, ``chunk_size``, ``workers``, ...) go to ``ckptfmt.save``.
    """

    def __init__(self, storage_options: dict | None = None, *, async_save: bool = False,
                 collect_garbage: bool = True, **save_options: Any):
        set_here = sorted(set(save_options) & _SET_PER_SAVE)
        if set_here:
            raise TypeError(f"CkptfmtCheckpointIO sets {set_here[0]!r} itself for each save")
        self.options = SaveOptions.from_keywords("CkptfmtCheckpointIO", save_options)
        self.storage_options = storage_options
        self.collect_garbage = collect_garbage
        #: The asynchronous saver and its staging buffers (async_save=True), freed by ``teardown``.
        self.saver = AsyncSaver() if async_save else None
        self._background: ThreadPoolExecutor | None = None
        self._tasks: list[Future] = []
        self._lock = threading.Lock()
        #: Checkpoint names taken by saves still in flight, per repository.
        self._naming: dict[str, set[str]] = {}

    # -- CheckpointIO ------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as a new checkpoint of ``path``'s folder, then point ``path`` at it."""
        self.raise_background_error()
        checkpoint = dict(checkpoint)
        gathered = checkpoint.pop(STEPS_KEY, None)
        checkpoint.pop(TIMER_KEY, None)
        options = storage_options if storage_options is not None else self.storage_options
        repo_url, pointer = _locate(path)
        repo = Repository.open(repo_url, options, create=True)
        name = self.new_name(repo, pointer)
        self.save_and_point(checkpoint, repo, pointer, name, storage_options=options, coordinated=False,
                            gathered_steps=gathered)

    def save_and_point(self, checkpoint: dict[str, Any], repo: Repository, pointer: str, name: str, *,
                       timer: StepTimer | None = None, **options: Any) -> None:
        """Save ``checkpoint`` as checkpoint ``name`` of ``repo`` (``options`` for this save), then, on the
        rank that writes pointers (rank 0), point ``pointer`` at it: in the background if saves are."""
        step = checkpoint.get("global_step")
        save_options = self.options.replace(
            step=step if isinstance(step, int) and not isinstance(step, bool) else None,
            metadata={"lightning": {"path": pointer, "epoch": checkpoint.get("epoch"), "global_step": step}},
            **options)
        url = f"{repo.url}/{name}"
        points = current_rank()[0] == 0 or save_options.group.alone
        try:
            if self.saver is None:
                save_with(checkpoint, url, save_options, timer=timer)
                if points:
                    self._point(repo, pointer, name)
                else:
                    self._release_name(repo.url, name)
                return
            saved = self.saver.save(checkpoint, url, save_options, timer=timer)
        except BaseException:
            self._release_name(repo.url, name)
            raise
        self._submit(self._point_once_saved if points else self._wait_for_save, saved, repo, pointer, name)

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint ``path`` points at (or, for a torch.save file there, that file's contents)."""
        url = self.checkpoint_url(path)
        if url is not None:
            _RESUMED[:] = [(url, self.storage_options)]  # StepTimingCallback records what the resume restored
            return load(url, storage_options=self.storage_options, mmap=False)
        return TorchCheckpointIO().load_checkpoint(os.fspath(path), map_location=map_location,
                                                   weights_only=weights_only)

    def checkpoint_url(self, path: str | os.PathLike) -> str | None:
        """The URL of the ckptfmt checkpoint at Lightning's ``path`` (its pointer's, or the path itself when
        it names a checkpoint), after the saves in flight; None for a torch.save file there."""
        self._wait_for_background()
        repo_url, pointer = _locate(path)
        storage = open_storage(repo_url, self.storage_options)
        if storage.exists(layout.MARKER_KEY):  # a ckptfmt repository: a pointer, or a checkpoint's own URL
            repo = Repository.open(repo_url, self.storage_options)
            data = read_small(repo.storage, pointer)
            if data is not None and looks_like_pointer(data):
                return f"{repo_url}/{pointed_name(data, repo.storage.describe(pointer))}"
            if data is None and repo.storage.exists(layout.commit_key(pointer)):
                return f"{repo_url}/{pointer}"
        if _size(storage, pointer) is not None:  # a torch.save file: a run that switched to ckptfmt
            return None
        raise CheckpointNotFoundError(f"{storage.describe(pointer)}: no checkpoint there")

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Remove the checkpoint ``path`` points at (after the saves in flight), and its pointer."""
        self.raise_background_error()
        repo_url, pointer = _locate(path)
        self._submit(self._remove, repo_url, pointer)

    def teardown(self) -> None:
        """Wait for the saves and removals in flight (raising their first error), then free the staging
        buffers and the background thread."""
        try:
            self._wait_for_background()
        finally:
            with self._lock:
                background, self._background = self._background, None
            if background is not None:
                background.shutdown(wait=True)
            if self.saver is not None:
                self.saver.close()

    # -- the work behind the calls ---------------------------------------------------------------
    def _point_once_saved(self, saved: Future, repo: Repository, pointer: str, name: str) -> None:
        self._wait_for_save(saved, repo, pointer, name)
        self._point(repo, pointer, name)

    def _wait_for_save(self, saved: Future, repo: Repository, pointer: str, name: str) -> None:
        try:
            saved.result()
        finally:
            self._release_name(repo.url, name)

    def _point(self, repo: Repository, pointer: str, name: str) -> None:
        """Point ``pointer`` at the committed checkpoint ``name``; the checkpoint it pointed at goes."""
        data = read_small(repo.storage, pointer)
        previous = pointed_name(data, pointer) if data is not None and looks_like_pointer(data) else None
        body = {"format": POINTER_FORMAT, "checkpoint": name}
        repo.storage.write(pointer, (json.dumps(body) + "\n").encode())
        if previous is not None and previous != name:  # off the training thread, after what is queued
            self._submit(self._drop, repo, [previous])

    def _remove(self, repo_url: str, pointer: str) -> None:
        repo = Repository.open(repo_url, self.storage_options)
        data = read_small(repo.storage, pointer)
        if data is None or not looks_like_pointer(data):
            return  # nothing of ours there (Lightning may remove what it never saved through us)
        repo.storage.delete(pointer)
        self._drop(repo, [pointed_name(data, repo.storage.describe(pointer))])

    def _drop(self, repo: Repository, names: list[str]) -> None:
        remove(repo, names)
        if self.collect_garbage:
            collect(repo)

    def new_name(self, repo: Repository, pointer: str) -> str:
        """A checkpoint name for ``pointer``: its stem in the characters names allow, made unique."""
        stem = pointer[: -len(".ckpt")] if pointer.endswith(".ckpt") else pointer
        base = _NOT_IN_NAMES.sub("_", stem).lstrip("._-")[: MAX_NAME_LENGTH - 8] or "checkpoint"
        with self._lock:
            taken = self._naming.setdefault(repo.url, set())
            for number in range(1, 100_000):
                name = base if number == 1 else f"{base}-{number}"
                # Not a name whose folder is still there: a removal in flight (its commit record gone, its
                # manifest not yet) would take the new save's files with it, and gc would find a checkpoint
                # that lost its commit record (seen: examples/lightning_example.py, 1 run in 10).
                if name == pointer or name in taken or repo.storage.exists(name):
                    continue
                taken.add(name)
                return name
        raise InvalidNameError(f"{repo.url}: no free checkpoint name for {pointer!r}")

    def _release_name(self, repo_url: str, name: str) -> None:
        with self._lock:
            self._naming.get(repo_url, set()).discard(name)

    # -- the background thread: pointer moves and removals, in call order ---------------------------
    def _submit(self, work, *args: Any) -> None:
        with self._lock:
            if self._background is None:
                self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfmt-lightning")
            self._tasks = [task for task in self._tasks if not task.done() or task.exception() is not None]
            self._tasks.append(self._background.submit(work, *args))

    def raise_background_error(self) -> None:
        """Raise the first error of the background work (an asynchronous save, a removal) not yet raised."""
        with self._lock:
            failed = [task for task in self._tasks if task.done() and task.exception() is not None]
            self._tasks = [task for task in self._tasks if task not in failed]
        if failed:
            error = failed[0].exception()
            assert error is not None
            raise error

    def _wait_for_background(self) -> None:
        while True:  # a task may queue another (a replaced checkpoint's removal)
            with self._lock:
                tasks, self._tasks = self._tasks, []
            if not tasks:
                return
            for task in tasks:
                task.result()


class CkptfmtModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism over a DeviceMesh) saving
    through ckptfmt instead of ``torch.distributed.checkpoint``: every rank writes its own shards of one
    checkpoint (a collective save: DTensors stored as their boxes, replicated values once), and a load
    fills the model's and optimizers' sharded states in place, at any world size or mesh.

    Paths, pointers, removal and ``async_save`` are those of ``checkpoint_io`` (a ``CkptfmtCheckpointIO``,
    made with defaults if not given); with ``StepTimingCallback``, each checkpoint holds every rank's steps.
    """

    def __init__(self, *args: Any, checkpoint_io: CkptfmtCheckpointIO | None = None, **kwargs: Any):
        if kwargs.setdefault("save_distributed_checkpoint", True) is not True:
            raise ValueError("CkptfmtModelParallelStrategy saves sharded checkpoints (each rank its shards)")
        super().__init__(*args, **kwargs)
        self.checkpoint_io = checkpoint_io if checkpoint_io is not None else CkptfmtCheckpointIO()

    def _ckptfmt(self) -> CkptfmtCheckpointIO:
        io = self.checkpoint_io
        if not isinstance(io, CkptfmtCheckpointIO):
            raise TypeError("CkptfmtModelParallelStrategy needs a CkptfmtCheckpointIO as its checkpoint_io")
        return io

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """On every rank: one collective ckptfmt save of the checkpoint, sharded states included."""
        io = self._ckptfmt()
        io.raise_background_error()
        checkpoint = dict(checkpoint)
        timer = checkpoint.pop(TIMER_KEY, None)
        checkpoint.pop(STEPS_KEY, None)
        options = storage_options if storage_options is not None else io.storage_options
        repo_url, pointer = _locate(self.broadcast(os.fspath(filepath)))
        if self.global_rank == 0:
            repo = Repository.open(repo_url, options, create=True)
        self.barrier("ckptfmt: repository")  # rank 0 creates it before the others open it
        if self.global_rank != 0:
            repo = Repository.open(repo_url, options)
        name: str = self.broadcast(io.new_name(repo, pointer) if self.global_rank == 0 else "")
        io.save_and_point(checkpoint, repo, pointer, name, timer=timer, storage_options=options)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """On every rank: the model's and optimizers' sharded states filled in place from the checkpoint
        (resharded to this run's mesh); returns the rest of the checkpoint, as Lightning expects."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        url = self._ckptfmt().checkpoint_url(self.broadcast(os.fspath(checkpoint_path)))
        if url is None:  # a torch.save file or DCP folder of an earlier run: Lightning reads it
            return super().load_checkpoint(os.fspath(checkpoint_path), weights_only=weights_only)
        assert self.model is not None and self.lightning_module is not None
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        model_state = get_model_state_dict(self.model)
        optimizer_states = [get_optimizer_state_dict(self.model, o) for o in optimizers]
        states: dict[str, Any] = {"state_dict": model_state, "optimizer_states": optimizer_states}
        with open_checkpoint(url, storage_options=self._ckptfmt().storage_options) as reader:
            load_into(reader, states, strict=self.lightning_module.strict_loading, rank=self.global_rank,
                      within=states)
            rest = reader.load_state(without=states)  # loops, callbacks, schedulers; small tensors read whole
        set_model_state_dict(self.model, model_state)  # filled in place by load_into
        for optimizer, state in zip(optimizers, optimizer_states):
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state)
        return rest


#: The checkpoint CkptfmtCheckpointIO loaded last in this process, and its storage options, until a
#: StepTimingCallback records the resume at the start of training.
_RESUMED: list[tuple[str, dict | None]] = []


def _loaders(loader: Any) -> list[Any]:
    """The training data loaders: Lightning may wrap them in a CombinedLoader, whose ``iterables`` are
    the loaders (a dict, a list, or one)."""
    loaders = getattr(loader, "iterables", loader)
    return list(loaders.values()) if isinstance(loaders, dict) else list(loaders) \
        if isinstance(loaders, (list, tuple)) else [loaders]


def _first_loader(loader: Any) -> Any:
    found = _loaders(loader)
    return found[0] if found else None


def _loader_generators(loader: Any) -> dict[str, Any]:
    """The torch generators a training data loader draws its order from (its own, its sampler's, its
    batch sampler's sampler's), by name, for the steps' signatures."""
    found: dict[str, Any] = {}
    for index, each in enumerate(_loaders(loader)):
        prefix = "loader" if index == 0 else f"loader{index}"
        batch_sampler = getattr(each, "batch_sampler", None)
        for suffix, owner in (("", each), (".sampler", getattr(each, "sampler", None)),
                              (".batch_sampler.sampler", getattr(batch_sampler, "sampler", None))):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and all(generator is not g for g in found.values()):
                found[prefix + suffix] = generator
    return found


class StepTimingCallback(Callback):
    """Times every training step on every rank, and hands every rank's steps to the next checkpoint.

    Phases: ``data`` (from the end of the previous step, or of validation, to the start of the
    batch: fetching it, and whatever Lightning ran in between, such as a checkpoint's write),
    ``forward_backward`` (the training step, to the optimizer step) and ``optimizer``; the
    metrics ``batch_idx``, ``epoch``, ``global_step`` and, where the step returns one, ``loss``.
    Steps are numbered by this callback across epochs and resumes. Use it with
    ``CkptfmtCheckpointIO``: the steps go into the checkpoints' run metadata (spec 9.4).

    A resume from a ckptfmt checkpoint also restores every rank's generators (torch, CUDA, NumPy,
    Python) as the save found them, which Lightning does not do (a resumed run would otherwise draw
    other dropout masks and shuffles than the uninterrupted run): ``restore_rng=False`` keeps
    Lightning's behaviour. Once a checkpoint is saved, every rank's steps since the last save go to
    its progress object every ``progress_interval`` seconds (spec 4.6; None: never), so that
    ``ckptfmt goodput`` sees what a killed job computed. Each checkpoint records the Trainer's
    settings that change what a step computes (``trainer/hyperparameters``: gradient clipping,
    accumulation, precision), so that ``ckptfmt compare`` and ``ckptfmt certify`` can name them.

    Each checkpoint also records the training loader's data position and its sampler's contract
    (``data_position``: epoch, samples consumed by the job, seed, dataset length and fingerprint,
    replicas, batch size, workers). A loader drawing from a ``ResumableSampler``
    (``DataLoader(data, batch_sampler=ResumableSampler(...))``, with ``use_distributed_sampler=False``)
    is restored to that position on resume, at any world size; any other loader restarts its epoch
    on a resume mid-epoch, as Lightning does, and the resume's record says so.
    """

    def __init__(self, *, restore_rng: bool = True, progress_interval: float | None = DEFAULT_PROGRESS_INTERVAL_S):
        self.timer = StepTimer(progress_interval=progress_interval)
        self.restore_rng = restore_rng
        #: The generators' check right after their restore, for the resume's record.
        self._generators_checked: list = []
        #: Steps started over the run (restored on resume): the next step's number.
        self.steps_started = 0
        self._since: int | None = None
        #: Batches of the training loader's current iteration the loop has taken.
        self._batches = 0
        #: The data position of the checkpoint resumed from, until the loader is there to restore.
        self._stored_position: Any = None
        #: Whether a checkpoint was saved through ckptfmt (its repository is there for progress objects).
        self._saved = False

    # -- the training loop -------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        """Lightning has restored the model, the optimizers and the schedulers by now: what they hold
        goes on record against the checkpoint they came from (``ckptfmt.record_resume``).

        A resume mid-epoch restores the generators again: the epoch's loader iterator, made since,
        drew its seed from them, which the uninterrupted run did before the checkpoint."""
        if _RESUMED:
            (url, storage_options), = _RESUMED
            _RESUMED.clear()
            checked, self._generators_checked = self._generators_checked, []
            if self.restore_rng and _mid_epoch(trainer):
                with open_checkpoint(url, storage_options=storage_options) as reader:
                    restore_rng(reader)
                    checked = [check_generators(reader)]
            if self._stored_position is not None:
                checked.append(self._restore_position(trainer))
            record_resume(url, {"state_dict": pl_module,
                                "optimizer_states": [optimizer.state_dict() for optimizer in trainer.optimizers],
                                "lr_schedulers": [config.scheduler.state_dict()
                                                  for config in trainer.lr_scheduler_configs]},
                          storage_options=storage_options, checked=checked)
        self._since = time.perf_counter_ns()  # a resumed run may start without on_train_epoch_start
        for name, generator in _loader_generators(trainer.train_dataloader).items():
            self.timer.track_generator(name, generator)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._since = time.perf_counter_ns()
        self._batches = 0

    def _restore_position(self, trainer) -> Any:
        """A ``ResumableSampler`` continues from the stored position (refusing another order); the
        loader's position, as the epoch will begin, then goes on record against the stored one."""
        stored, self._stored_position = self._stored_position, None
        loader = _first_loader(trainer.train_dataloader)
        sampler = resumable(loader)
        if sampler is not None and isinstance(stored, dict) and stored.get("resumable"):
            sampler.load_state_dict(stored)
        return check_position(stored, data_position(loader, 0, trainer.current_epoch))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.timer.in_step:  # the previous step never ended (an exception Lightning handled)
            self.timer.end_step()
        if self._saved and self.timer.progress is None:
            self._bind_progress(trainer)
        self.timer.start_step(self.steps_started, since_ns=self._since, phase="data")
        self.steps_started += 1
        self._batches += 1
        self.timer.mark("forward_backward")
        self.timer.metrics(batch_idx=batch_idx, epoch=trainer.current_epoch, global_step=trainer.global_step)
        self.timer.batch_tensors(batch)  # the step's signature: Lightning hands the batch, not its indices

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.timer.in_step:
            self.timer.mark("optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self.timer.in_step:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None and getattr(loss, "numel", lambda: 0)() == 1:
            self.timer.metrics(loss=float(loss))
        self.timer.end_step()
        self._since = time.perf_counter_ns()

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.training:
            self._since = time.perf_counter_ns()  # validation is not the next batch's fetch

    def _bind_progress(self, trainer) -> None:
        """Once the repository exists, every rank's steps since the last save go to its progress object
        (spec 4.6) as the timer's interval says, so that ``ckptfmt goodput`` sees what a killed job
        computed; a save that rank 0 makes alone never hands the other ranks' timers to a save."""
        io, folder = _ckptfmt_io(trainer), getattr(trainer.checkpoint_callback, "dirpath", None)
        if io is None or folder is None:
            return
        try:
            bind_repository(self.timer, str(folder), io.storage_options, trainer.global_rank)
        except CheckpointError:  # rank 0's first save not committed yet (an asynchronous one): next step
            pass

    # -- checkpoints ---------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """On every rank, as Lightning prepares a checkpoint: a collective save (the sharded strategy)
        takes each rank's timer; a save that rank 0 makes alone gets every rank's steps, gathered."""
        if not _saves_through_ckptfmt(trainer):
            return
        self._saved = True
        checkpoint[SETTINGS_KEY] = {"hyperparameters": trainer_settings(trainer)}
        position = data_position(_first_loader(trainer.train_dataloader), self._batches, trainer.current_epoch)
        if position is not None:
            checkpoint[DATA_KEY] = position
        if isinstance(trainer.strategy, CkptfmtModelParallelStrategy):
            checkpoint[TIMER_KEY] = self.timer
        else:  # the same answer on every rank: all gather or none
            gathered = gather_steps(self.timer)
            if gathered is not None:
                checkpoint[STEPS_KEY] = gathered

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """Lightning restores the callbacks first, before it makes the first epoch's data loader
        iterator (which draws its seeds): the generators are restored here, as the save found them."""
        self._stored_position = checkpoint.get(DATA_KEY)
        if _RESUMED:
            (url, storage_options), = _RESUMED
            with open_checkpoint(url, storage_options=storage_options) as reader:
                if self.restore_rng:
                    restore_rng(reader)
                self._generators_checked = [check_generators(reader)]  # not restored: on record as such

    def state_dict(self) -> dict[str, Any]:
        return {"steps_started": self.steps_started}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps_started = int(state_dict.get("steps_started", 0))


def _mid_epoch(trainer) -> bool:
    """Whether a restored run stands within an epoch (a checkpoint saved after the epoch's last batch
    is the next epoch's start)."""
    ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    return 0 < ready < trainer.num_training_batches


def trainer_settings(trainer) -> dict[str, Any]:
    """The Trainer's arguments that change what a training step computes (plain values)."""
    def text(value: Any) -> str | None:  # enums (the clipping algorithm) as their values
        return None if value is None else str(getattr(value, "value", value))
    clip = trainer.gradient_clip_val
    return {"gradient_clip_val": clip if clip is None or isinstance(clip, (int, float)) else float(clip),
            "gradient_clip_algorithm": text(trainer.gradient_clip_algorithm),
            "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
            "precision": text(getattr(trainer, "precision", None))}


def _ckptfmt_io(trainer) -> CkptfmtCheckpointIO | None:
    """The trainer's CkptfmtCheckpointIO (wrapped, say, in AsyncCheckpointIO), if its checkpoints go through one."""
    io = getattr(trainer.strategy, "checkpoint_io", None)
    while io is not None and not isinstance(io, CkptfmtCheckpointIO):
        io = getattr(io, "checkpoint_io", None)
    return io


def _saves_through_ckptfmt(trainer) -> bool:
    return _ckptfmt_io(trainer) is not None


def _size(storage: Storage, key: str) -> int | None:
    """The size of the object at ``key``; None where there is none, or a folder."""
    try:
        return storage.size(key)
    except CorruptDataError:  # a folder (a checkpoint's), a device: no object
        return None


def _locate(path: str | os.PathLike) -> tuple[str, str]:
    """The repository (the path's folder) and the pointer's key (its last segment) of a Lightning path."""
    text = os.fspath(path)
    if "://" in text:
        folder, _, key = text.rstrip("/").rpartition("/")
        return folder, key
    folder, key = os.path.split(os.path.abspath(text))
    return folder, key


