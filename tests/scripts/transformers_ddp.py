"""A Hugging Face Trainer DDP run on CPU ranks (gloo) saving through ckptfmt.

    torchrun --nproc_per_node 2 transformers_ddp.py REPO OUTPUT_DIR STEPS STOP_AT WEIGHTS

Saves every 8 steps to REPO and resumes from its newest checkpoint if there is one; stops after
step STOP_AT (0: runs to STEPS). Rank 1 sleeps 0.25 s while collating batches 10..13. Rank 0
writes the final weights to WEIGHTS (torch.save).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

from ckptfmt.integrations.transformers import CkptfmtCallback
from tests.support.hf_training import Record, SlowFetches, arguments, trainer


def main() -> None:
    repo, output_dir, steps, stop_at, weights = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        sys.argv[5]
    rank = int(os.environ["RANK"])
    saving = CkptfmtCallback(repo)
    args = arguments(output_dir, max_steps=steps, save_steps=8, logging_steps=4)
    run = trainer(args, [Record(stop_at or None), saving],
                  collator=SlowFetches(0.25 if rank == 1 else 0.0, 10, 13))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.train(resume_from_checkpoint=saving.resume_folder(args))
    if rank == 0:
        torch.save(run.model.state_dict(), weights)


if __name__ == "__main__":
    main()
