"""What saving through a framework integration costs against the framework's own save of the same state.

Usage (from the repository root)::

    python bench/integrations.py [--size-gb 0.3] [--repeats 7] [--dir /tmp]

Lightning: a transformer-shaped LightningModule (bench/harness.py's layers) with AdamW state after one
step, saved by ``trainer.save_checkpoint`` through

- ``torch``: Lightning's own ``TorchCheckpointIO`` as it is (torch.save; no fsync, so the bytes may
  still be in the page cache when it returns),
- ``torch+fsync``: the same, then an fsync of the file (as durable as a ckptfmt save),
- ``ckptfmt``: ``CkptfmtCheckpointIO()`` (durable when it returns),
- ``ckptfmt async``: ``CkptfmtCheckpointIO(async_save=True)``: the time the training thread waits
  (staging into reused buffers); the background write is waited for, untimed, before the next save.

Every repeat first changes every tensor's content, so no save finds its chunks already stored,
and rotates the order of the competitors. Prints each one's median and, per competitor, the median
of its per-repeat ratios to ``torch`` and ``torch+fsync`` with their range.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lightning as L
from harness import build_state, console, refresh_content, round_robin, state_nbytes, timed
from lightning.pytorch.plugins.io import TorchCheckpointIO
from rich.table import Table

from ckptfmt.integrations.lightning import CkptfmtCheckpointIO


class Transformerish(L.LightningModule):
    """The bench state as parameters, trained one step so that AdamW holds both moments."""

    def __init__(self, size_gb: float):
        super().__init__()
        state = build_state(size_gb)
        self.names = list(state)
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(t) for t in state.values())

    def training_step(self, batch, batch_idx):
        return sum(p.sum() for p in self.weights) * 0.0 + batch.sum() * 0.0

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def trained(size_gb: float) -> L.Trainer:
    model = Transformerish(size_gb)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, torch.utils.data.DataLoader(torch.zeros(4, 1), batch_size=1))
    return trainer


def refresh(trainer: L.Trainer, tag: int) -> None:
    """New content in every parameter and optimizer moment."""
    with torch.no_grad():
        refresh_content({str(i): p for i, p in enumerate(trainer.lightning_module.parameters())}, tag)
        moments = {f"{i}.{name}": value for i, state in enumerate(trainer.optimizers[0].state.values())
                   for name, value in state.items() if value.dim() > 0}
        refresh_content(moments, tag + 1)


def competitors(trainer: L.Trainer, root: Path) -> dict:
    strategy = trainer.strategy
    asynchronous = CkptfmtCheckpointIO(async_save=True)

    def torch_save(fsync: bool):
        def run(rep: int) -> float:
            strategy.checkpoint_io = TorchCheckpointIO()
            path = root / f"torch-{fsync}-{rep}.ckpt"

            def save():
                trainer.save_checkpoint(path)
                if fsync:
                    with open(path, "rb") as f:
                        os.fsync(f.fileno())
            seconds, _ = timed(save)
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

    return {"torch": torch_save(False), "torch+fsync": torch_save(True), "ckptfmt": ckptfmt_save,
            "ckptfmt async": ckptfmt_async}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=0.3, help="parameters; AdamW adds twice as much")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp folder)")
    args = parser.parse_args()
    trainer = trained(args.size_gb)
    nbytes = 3 * state_nbytes({str(i): p for i, p in enumerate(trainer.lightning_module.parameters())})
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        results = round_robin("lightning", competitors(trainer, Path(folder)), args.repeats,
                              before_repeat=lambda rep: refresh(trainer, 2 * rep))
    table = Table(title=f"Lightning trainer.save_checkpoint, {nbytes / 1e9:.2f} GB (weights + AdamW), "
                        f"{args.repeats} repeats", title_justify="left")
    for column in ("save through", "median", "vs torch (range)", "vs torch+fsync (range)"):
        table.add_column(column, justify="left" if column == "save through" else "right")
    for name, result in results.items():
        row = [name, f"{result.median:.3f} s"]
        for base in ("torch", "torch+fsync"):
            ratios = [a / b for a, b in zip(result.times, results[base].times)]
            row.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-")
        table.add_row(*row)
    console.print(table)


if __name__ == "__main__":
    main()
