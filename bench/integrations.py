"""What saving through a framework integration costs against the framework's own save of the same state.

Usage (from the repository root)::

    python bench/integrations.py [lightning|transformers|accelerate|torchtitan ...] [--size-gb 0.3]
        [--repeats 7] [--dir /tmp]

The state is bench/harness.py's transformer-shaped layers as one module's parameters with AdamW state
after one step (AdamW adds twice the parameters' bytes). Each framework's own save, as it is and
followed by an fsync of what it wrote (as durable as a ckptfmt save, which is durable when it
returns), against the integration, synchronous and asynchronous (the time the training thread
waits; the background write is waited for, untimed, before the next save).

- lightning: ``trainer.save_checkpoint`` through Lightning's ``TorchCheckpointIO`` (torch.save),
  ``CkptfmtCheckpointIO()`` and ``CkptfmtCheckpointIO(async_save=True)``.
- transformers: what the Trainer runs at a save (``Trainer._save_checkpoint``: the checkpoint-N
  folder of model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth and trainer_state.json)
  against ``CkptfmtCallback``'s save at the same moment (its ``on_step_end`` with the Trainer's
  decision to save), and with ``async_save=True``.
- accelerate: ``accelerator.save_state(folder)`` (model.safetensors, optimizer.bin, random states)
  against ``ckptfmt.integrations.accelerate.save_state`` (no asynchronous mode).
- torchtitan: its own DCP ``CheckpointManager`` (``async_mode="disabled"``; DCP fsyncs what it
  writes) against ``CkptfmtCheckpointManager``, synchronous and ``async_mode="async"``, each
  ``save(step)`` of the same model, OptimizersContainer and schedulers on one process.

Every repeat first changes every tensor's content, so no save finds its chunks already stored,
and rotates the order of the competitors. Prints each one's median and, per competitor, the median
of its per-repeat ratios to the framework's own save and to it with an fsync, with their range.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Result, build_state, console, files_under, fsync_path, refresh_content, round_robin, timed
from rich.table import Table


class Bench:
    """One framework's competitors over one trained state: ``competitors`` maps a name to
    ``fn(repeat) -> seconds``; ``refresh(repeat)`` gives every parameter and moment new content."""

    own = "own"
    competitors: dict[str, Callable[[int], float]]

    def __init__(self, parameters: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer):
        self.parameters, self.optimizer = parameters, optimizer
        self.nbytes = 3 * sum(p.numel() * p.element_size() for p in parameters)

    def refresh(self, repeat: int) -> None:
        """New content before each repeat (two tags per repeat: parameters, moments)."""
        tag = 2 * repeat
        with torch.no_grad():
            refresh_content({str(i): p for i, p in enumerate(self.parameters)}, tag)
            moments = {f"{i}.{name}": value for i, state in enumerate(self.optimizer.state.values())
                       for name, value in state.items() if value.dim() > 0}
            refresh_content(moments, tag + 1)

    def close(self) -> None:
        """Finish what the competitors left running (background writes) before their folder goes."""


def layers(size_gb: float) -> torch.nn.ParameterList:
    return torch.nn.ParameterList(torch.nn.Parameter(t) for t in build_state(size_gb).values())


def fsynced(save: Callable[[], None], written: Callable[[], Path]) -> Callable[[], None]:
    """``save``, then an fsync of every file under ``written()`` and of its folder."""
    def run() -> None:
        save()
        path = written()
        for file in files_under(path) if path.is_dir() else [path]:
            fsync_path(file)
        fsync_path(path.parent)
    return run


# ------------------------------------------------------------------------------------- Lightning


class LightningBench(Bench):
    own = "TorchCheckpointIO"

    def __init__(self, size_gb: float, root: Path):
        import lightning as L
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.weights = layers(size_gb)

            def training_step(self, batch, batch_idx):
                return sum(p.sum() for p in self.weights) * 0.0 + batch.sum() * 0.0

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-4)

        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Module(), torch.utils.data.DataLoader(torch.zeros(4, 1), batch_size=1))
        super().__init__(list(trainer.lightning_module.parameters()), trainer.optimizers[0])
        strategy, asynchronous = trainer.strategy, CkptfmtCheckpointIO(async_save=True)

        def torch_save(fsync: bool):
            def run(rep: int) -> float:
                strategy.checkpoint_io = TorchCheckpointIO()
                path = root / f"torch-{fsync}-{rep}.ckpt"
                save = lambda: trainer.save_checkpoint(path)
                seconds, _ = timed(fsynced(save, lambda: path) if fsync else save)
                path.unlink()
                return seconds
            return run

        def ckptfmt_save(rep: int) -> float:
            strategy.checkpoint_io = CkptfmtCheckpointIO(collect_garbage=False)
            seconds, _ = timed(lambda: trainer.save_checkpoint(root / "ckptfmt" / f"step-{rep}.ckpt"))
            return seconds

        def ckptfmt_async(rep: int) -> float:
            strategy.checkpoint_io = asynchronous
            seconds, _ = timed(lambda: trainer.save_checkpoint(root / "async" / f"step-{rep}.ckpt"))
            asynchronous.teardown()  # the write finishes before anything else is timed
            return seconds

        self.competitors = {self.own: torch_save(False), f"{self.own}+fsync": torch_save(True),
                            "CkptfmtCheckpointIO": ckptfmt_save, "CkptfmtCheckpointIO async": ckptfmt_async}


# ------------------------------------------------------------------------ Hugging Face Trainer


class TransformersBench(Bench):
    own = "checkpoint-N folder"

    def __init__(self, size_gb: float, root: Path):
        from transformers import Trainer, TrainerControl, TrainingArguments

        from ckptfmt.integrations.transformers import CkptfmtCallback

        class Module(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weights = layers(size_gb)

            def forward(self, x):
                return {"loss": sum(p.sum() for p in self.weights) * 0.0 + x.sum() * 0.0}

        args = TrainingArguments(str(root / "hf"), max_steps=1, per_device_train_batch_size=1,
                                 save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
        trainer = Trainer(Module(), args, train_dataset=[{"x": torch.zeros(1)}] * 4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        super().__init__(list(trainer.model.parameters()), trainer.optimizer)
        hooks = dict(model=trainer.model, optimizer=trainer.optimizer, lr_scheduler=trainer.lr_scheduler)

        def trainer_save(fsync: bool):
            def run(rep: int) -> float:
                trainer.state.global_step = rep
                folder = Path(args.output_dir) / f"checkpoint-{rep}"
                save = lambda: trainer._save_checkpoint(trainer.model, trial=None)
                seconds, _ = timed(fsynced(save, lambda: folder) if fsync else save)
                shutil.rmtree(folder)
                return seconds
            return run

        def callback_save(name: str, **options):
            callback = CkptfmtCallback(root / name, **options)
            callback.on_train_begin(args, trainer.state, TrainerControl())

            def run(rep: int) -> float:
                trainer.state.global_step = rep
                control = TrainerControl(should_save=True)
                seconds, _ = timed(lambda: callback.on_step_end(args, trainer.state, control, **hooks))
                callback.manager.wait()  # the write finishes before anything else is timed
                return seconds
            return run

        self.competitors = {self.own: trainer_save(False), f"{self.own}+fsync": trainer_save(True),
                            "CkptfmtCallback": callback_save("ckptfmt"),
                            "CkptfmtCallback async": callback_save("async", async_save=True)}


# ------------------------------------------------------------------------------------ Accelerate


class AccelerateBench(Bench):
    own = "accelerator.save_state"

    def __init__(self, size_gb: float, root: Path):
        from accelerate import Accelerator

        from ckptfmt.integrations import accelerate as integration

        accelerator = Accelerator(cpu=True)
        module = torch.nn.Module()
        module.weights = layers(size_gb)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        module, optimizer = accelerator.prepare(module, optimizer)
        sum(p.sum() for p in module.parameters()).backward()
        optimizer.step()
        super().__init__(list(module.parameters()), optimizer.optimizer)

        def own_save(fsync: bool):
            def run(rep: int) -> float:
                folder = root / f"own-{fsync}-{rep}"
                save = lambda: accelerator.save_state(str(folder))
                seconds, _ = timed(fsynced(save, lambda: folder) if fsync else save)
                shutil.rmtree(folder)
                return seconds
            return run

        def ckptfmt_save(rep: int) -> float:
            seconds, _ = timed(lambda: integration.save_state(accelerator, root / "ckptfmt" / f"step-{rep}"))
            return seconds

        self.competitors = {self.own: own_save(False), f"{self.own}+fsync": own_save(True),
                            "ckptfmt save_state": ckptfmt_save}


class TorchtitanBench(Bench):
    own = "torchtitan DCP manager"

    def __init__(self, size_gb: float, root: Path):
        from torchtitan.components.checkpointer.dcp import CheckpointManager
        from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
        from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

        from ckptfmt.integrations.torchtitan import CkptfmtCheckpointManager

        # torchtitan's manager asks for this process's rank: a group of one
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
        module = torch.nn.Module()
        module.weights = layers(size_gb)
        optimizers = OptimizersContainer.Config(
            implementation="for-loop",
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-4})],
        ).build(model_parts=[module])
        sum(p.sum() for p in module.parameters()).backward()
        optimizers.step()
        lr_schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=1000)
        super().__init__(list(module.parameters()), optimizers.optimizers[0])

        self.checkpointers: list = []

        def manager(kind, folder: str, **options):
            checkpointer = kind.Config(enable=True, folder=str(root / folder), interval=1, keep_latest_k=2,
                               last_save_model_only=False, **options).build(
                dataloader=None, model_parts=[module], optimizers=optimizers, lr_schedulers=lr_schedulers,
                states={}, sd_adapter=None)
            self.checkpointers.append(checkpointer)
            return checkpointer

        def own_save(fsync: bool):
            checkpointer = manager(CheckpointManager, f"own-{fsync}")

            def run(rep: int) -> float:
                folder = root / f"own-{fsync}" / f"step-{rep + 1}"
                save = lambda: checkpointer.save(rep + 1)
                seconds, _ = timed(fsynced(save, lambda: folder) if fsync else save)
                shutil.rmtree(folder)
                return seconds
            return run

        def ckptfmt_save(folder: str, **options):
            checkpointer = manager(CkptfmtCheckpointManager, folder, **options)

            def run(rep: int) -> float:
                checkpointer.maybe_wait_for_saving()  # the previous background write, untimed
                seconds, _ = timed(lambda: checkpointer.save(rep + 1))
                return seconds
            return run

        self.competitors = {self.own: own_save(False), f"{self.own}+fsync": own_save(True),
                            "CkptfmtCheckpointManager": ckptfmt_save("ckptfmt"),
                            "CkptfmtCheckpointManager async": ckptfmt_save("ckptfmt-async", async_mode="async")}

    def close(self) -> None:
        for checkpointer in self.checkpointers:
            checkpointer.close()
        torch.distributed.destroy_process_group()


FRAMEWORKS: dict[str, type[Bench]] = {"lightning": LightningBench, "transformers": TransformersBench,
                                      "accelerate": AccelerateBench, "torchtitan": TorchtitanBench}


def report(name: str, bench: Bench, results: dict[str, Result], repeats: int) -> None:
    table = Table(title=f"{name}: {bench.nbytes / 1e9:.2f} GB (weights + AdamW), {repeats} repeats",
                  title_justify="left")
    bases = (bench.own, f"{bench.own}+fsync")
    for column in ("save through", "median", *(f"vs {base} (range)" for base in bases)):
        table.add_column(column, justify="left" if column == "save through" else "right")
    for competitor, result in results.items():
        row = [competitor, f"{result.median:.3f} s"]
        for base in bases:
            ratios = [a / b for a, b in zip(result.times, results[base].times)]
            row.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-")
        table.add_row(*row)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("frameworks", nargs="*", choices=[[], *FRAMEWORKS], default=[],
                        help="which (default: all)")
    parser.add_argument("--size-gb", type=float, default=0.3, help="parameters; AdamW adds twice as much")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp folder)")
    args = parser.parse_args()
    for name in args.frameworks or FRAMEWORKS:
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            bench = FRAMEWORKS[name](args.size_gb, Path(folder))
            results = round_robin(name, bench.competitors, args.repeats, before_repeat=bench.refresh)
            bench.close()
            report(name, bench, results, args.repeats)


if __name__ == "__main__":
    main()
