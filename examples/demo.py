"""A small training run that checkpoints with ckptfmt every few steps (``make demo``).

    python examples/demo.py REPO [--steps 30] [--every 10]

It trains a tiny transformer language model on synthetic tokens, saves model,
optimizer, scheduler, counters and step timings, then resumes from the latest
checkpoint and checks that training continues bit-for-bit identically.
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
    args = parser.parse_args(argv)

    model, optimizer, scheduler = make_run()
    losses: list[float] = []
    step_times: list[float] = []
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        losses.append(train_step(model, optimizer, scheduler))
        step_times.append(time.perf_counter() - started)
        if step % args.every == 0:
            url = ckptfmt.save(
                training_state(model, optimizer, scheduler, step, losses), f"{args.repo}/step-{step:06d}",
                step=step, metadata={"run": "demo", "loss": losses[-1]}, step_times=step_times,
            )
            step_times = []
            print(f"step {step:4d}  loss {losses[-1]:.4f}  saved {url}")

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
