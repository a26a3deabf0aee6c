"""A saving process for the gc race test: saves into one repository until told to stop.

``python gc_race_worker.py REPO WRITER MODE STOP_FILE PAUSE_S`` (MODE: sync or async).
Every save changes one of 4 tensors of the previous state, so it reuses most
chunks of its parent (12 of 16); both writers start from the same tensors, so they also
find each other's chunks. Random pauses (0 to PAUSE_S seconds) spread the
saves over the collector's loop. Prints one JSON line at the end: saves committed, failures.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import torch

import ckptfmt

TENSORS = 4
ELEMENTS = 65536  # 256 KiB of float32 (not packed with others): 4 chunks of 64 KiB


def main() -> None:
    repo, writer, mode, stop, pause = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])
    rng = random.Random(writer)
    generator = torch.Generator().manual_seed(0)
    state = {f"t{k}": torch.randn(ELEMENTS, generator=generator) for k in range(TENSORS)}
    committed, failures, pending = 0, [], None
    step = 0
    while not os.path.exists(stop):
        step += 1
        state[f"t{rng.randrange(TENSORS)}"] = torch.randn(ELEMENTS, generator=generator)
        url = f"{repo}/w{writer}-{step:05d}"
        try:
            if mode == "async":
                if pending is not None:
                    pending.result()
                    committed += 1
                pending = ckptfmt.async_save(state, url, step=step, chunk_size=65536)
            else:
                ckptfmt.save(state, url, step=step, chunk_size=65536)
                committed += 1
        except ckptfmt.CheckpointError as exc:
            failures.append(str(exc))
            pending = None
        time.sleep(rng.random() * pause)
    if pending is not None:
        try:
            pending.result()
            committed += 1
        except ckptfmt.CheckpointError as exc:
            failures.append(str(exc))
    print(json.dumps({"committed": committed, "failures": failures}))


if __name__ == "__main__":
    main()
