"""What the racing writers of tests/storage/test_s3_faults.py save (tests/scripts/s3_race_worker.py): one
state per writer and seed, so the test knows whose checkpoint won."""

from __future__ import annotations

import torch


def race_state(writer: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"writer": writer, "seed": seed, "w": torch.randn(20_000, generator=g)}
