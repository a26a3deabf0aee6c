"""Delta encoding measured on real training: what each ``compression`` stores and how fast it saves and
loads, for checkpoints of a small transformer trained on CPU in fp32 and in bf16.

Usage (from the repository root)::

    python bench/delta.py [--steps 2000] [--bf16-steps 600] [--dim 256] [--layers 2]
                          [--bf16-dim D] [--bf16-layers L] [--only fp32|bf16]

A byte-level GPT (embedding, ``--layers`` pre-norm blocks of attention and a 4x MLP, a tied
head) trains on ckptfmt's own source code with AdamW for ``--steps`` steps with fp32 weights
and ``--bf16-steps`` with bf16 weights (AdamW's moments then bf16 too; CPUs run bf16 about 3x
slower; ``--bf16-dim`` and ``--bf16-layers`` train a smaller model in bf16). Its state (model and
optimizer) is kept at every 10th step. Each sequence of checkpoints (every 10, 100 and 1000
steps) is then saved into a fresh repository with each compression (``none``, ``zstd``,
``shuffle-zstd``, ``delta-zstd``, ``auto``), in an order that rotates between sequences.
Prints, per dtype, interval and compression: the bytes stored after the first checkpoint (what
a delta can save), the ratio to ``none``, the median save time per checkpoint, and the time to
load the last checkpoint (through its whole chain of deltas).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import console

import ckptfmt

COMPRESSIONS = [None, "zstd", "shuffle-zstd", "delta-zstd", "auto"]
ROOT = Path(__file__).resolve().parents[1]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, dim: int, layers: int, context: int):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.position = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, 4) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf"), dtype=self.position.dtype), 1)
        x = self.embed(tokens) + self.position[:n]
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x) @ self.embed.weight.T


def corpus() -> torch.Tensor:
    text = b"".join(p.read_bytes() for p in sorted((ROOT / "ckptfmt").rglob("*.py")))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def training(dtype: torch.dtype, steps: int, dim: int, layers: int):
    """TinyGPT trained on the corpus with AdamW: yields (step, model, optimizer) after each step, and prints
    the run's time, final loss and size at its end."""
    torch.manual_seed(0)
    context, batch = 64, 16
    data = corpus()
    model = TinyGPT(dim, layers, context).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    started = time.perf_counter()
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(data) - context - 1, (batch,))
        tokens = torch.stack([data[s : s + context + 1] for s in starts.tolist()])
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 256), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        yield step, model, optimizer
    console.print(f"{str(dtype).removeprefix('torch.')}: {steps} steps in {time.perf_counter() - started:.0f} s, "
                  f"final loss {loss.item():.2f}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")


def train(dtype: torch.dtype, steps: int, dim: int, layers: int) -> dict[int, dict]:
    """The run's state (model and AdamW) at every 10th step, cloned."""
    return {step: {"model": {k: v.clone() for k, v in model.state_dict().items()},
                   "optim": _cloned(optimizer.state_dict()), "step": step}
            for step, model, optimizer in training(dtype, steps, dim, layers) if step % 10 == 0}


def _cloned(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    return value


def run_sequence(states: list[dict], compression: str | None, root: Path) -> dict:
    """Save ``states`` in order into a fresh repository; bytes after the first, save and load times."""
    repo = root / f"repo-{compression}"
    saves, new = [], []
    for index, state in enumerate(states):
        url = f"{repo}/step-{state['step']:06d}"
        start = time.perf_counter()
        ckptfmt.save(state, url, step=state["step"], compression=compression)
        saves.append(time.perf_counter() - start)
        if index:
            new.append(ckptfmt.Repository.open(str(repo)).commit(Path(url).name).totals["new_bytes"])
    start = time.perf_counter()
    loaded = ckptfmt.load(url, mmap=False)
    load_s = time.perf_counter() - start
    assert all(torch.equal(loaded["model"][k], v) for k, v in states[-1]["model"].items())
    return {"new": sum(new), "save": statistics.median(saves), "load": load_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--bf16-steps", type=int, default=600)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bf16-dim", type=int, help="model width in bf16 (default: --dim)")
    parser.add_argument("--bf16-layers", type=int, help="blocks in bf16 (default: --layers)")
    parser.add_argument("--only", choices=["fp32", "bf16"], help="train and measure one dtype")
    args = parser.parse_args()
    console.print(f"ckptfmt {ckptfmt.__version__}, torch {torch.__version__}")
    runs = {"fp32": (torch.float32, args.steps, args.dim, args.layers),
            "bf16": (torch.bfloat16, args.bf16_steps, args.bf16_dim or args.dim, args.bf16_layers or args.layers)}
    for name, (dtype, steps, dim, layers) in runs.items():
        if args.only not in (None, name):
            continue
        rows = []
        kept = train(dtype, steps, dim, layers)
        nbytes = sum(v.numel() * v.element_size() for v in kept[10]["model"].values())
        console.print(f"  model state {nbytes / 2**20:.1f} MiB, with AdamW's moments about 3x")
        for turn, interval in enumerate(i for i in (10, 100, 1000) if i < steps):
            states = [kept[s] for s in range(interval, steps + 1, interval) if s in kept]
            if interval == 10:
                states = states[:30]  # 30 checkpoints are enough to see a chain restart (every 8)
            if len(states) < 2:
                continue
            order = COMPRESSIONS[turn % len(COMPRESSIONS):] + COMPRESSIONS[:turn % len(COMPRESSIONS)]
            with tempfile.TemporaryDirectory(prefix="ckptfmt-delta-") as root:
                results = {c: run_sequence(states, c, Path(root)) for c in order}
            base = results[None]["new"]
            for compression in COMPRESSIONS:
                r = results[compression]
                rows.append((str(dtype).removeprefix("torch."), interval, len(states), compression or "none",
                             r["new"], base / r["new"] if r["new"] else math.inf, r["save"], r["load"]))
        print_rows(rows)


def print_rows(rows: list[tuple]) -> None:
    console.print(f"{'dtype':9} {'every':>5} {'ckpts':>5} {'compression':13} {'stored after 1st':>16} "
                  f"{'vs none':>7} {'save/ckpt':>9} {'load last':>9}")
    for dtype, interval, count, compression, new, ratio, save, load in rows:
        console.print(f"{dtype:9} {interval:5d} {count:5d} {compression:13} {new / 2**20:13.1f} MiB "
                      f"{ratio:6.2f}x {save * 1e3:7.0f} ms {load * 1e3:7.0f} ms")


if __name__ == "__main__":
    main()
