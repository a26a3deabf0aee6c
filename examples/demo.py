"""A small training run that checkpoints with ckptfmt every few steps (``make demo``).

    python examples/demo.py REPO [--steps 30] [--every 10] [--durable URL]

It trains a tiny transformer language model on synthetic tokens. A
``ckptfmt.CheckpointManager`` saves model, optimizer, scheduler, counters, the
loss and the step timings asynchronously every ``--every`` steps to REPO (the
fast tier: it keeps the last 2 and the best loss), and copies every 20th step
to ``--durable`` (another folder here, ``s3://bucket/run`` in a real run) in
the background. Then it resumes from the latest checkpoint and checks that
training continues bit-for-bit identically.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import ckptfmt


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True, dropout=0.1)
        self.blocks = nn.TransformerEncoder(block, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def make_run(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler) -> float:
    tokens = torch.randint(0, 512, (8, 32))
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


def training_state(model, optimizer, scheduler, step: int, losses: list[float]) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": step,
        "losses": list(losses),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--durable", default=None, help="the second tier (default: REPO-durable)")
    args = parser.parse_args(argv)
    durable = ckptfmt.Tier(args.durable or f"{args.repo}-durable", ckptfmt.Retention(keep_every=20))

    model, optimizer, scheduler = make_run()
    losses: list[float] = []
    timer = ckptfmt.StepTimer()
    with ckptfmt.CheckpointManager(tiers=[args.repo, durable], keep_last=2, keep_best=("loss", "min", 1),
                                   async_save=True, interval=args.every, name_format="step-{step:06d}") as manager:
        for step in range(1, args.steps + 1):
            with timer.step(step):
                losses.append(train_step(model, optimizer, scheduler))
            timer.metrics(loss=losses[-1])
            started = time.perf_counter()
            state = training_state(model, optimizer, scheduler, step, losses)
            if manager.save(step, state, metrics={"loss": losses[-1]}, timer=timer, metadata={"run": "demo"}):
                print(f"step {step:4d}  loss {losses[-1]:.4f}  saving step-{step:06d} in the background "
                      f"(training blocked {(time.perf_counter() - started) * 1e3:.1f} ms)")
    print(f"{args.repo} keeps steps {ckptfmt.CheckpointManager(args.repo).steps()}, "
          f"{durable.url} keeps steps {ckptfmt.CheckpointManager(durable.url).steps()}")

    # Resume from the latest checkpoint into a fresh run and check it continues identically.
    expected = [train_step(model, optimizer, scheduler) for _ in range(3)]
    resumed_model, resumed_optimizer, resumed_scheduler = make_run(seed=1234)
    state = ckptfmt.load(args.repo)
    resumed_model.load_state_dict(state["model"])
    resumed_optimizer.load_state_dict(state["optimizer"])
    resumed_scheduler.load_state_dict(state["scheduler"])
    ckptfmt.restore_rng(args.repo)
    got = [train_step(resumed_model, resumed_optimizer, resumed_scheduler) for _ in range(3)]
    verdict = "identical" if got == expected else f"DIFFERENT: {got} vs {expected}"
    print(f"resumed from step {state['step']}: next 3 losses {verdict}")
    if got != expected:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
