"""A training loop that a failure kills and a restart resumes, logging its own timeline, for
tests/analytics/test_goodput.py.

    goodput_run.py REPO STEPS KILL_AFTER LOG
    torchrun --nproc_per_node N goodput_run.py REPO STEPS KILL_AFTER LOG

Under torchrun the ranks join a gloo group, save collectively, and each logs to LOG.RANK; every rank
is killed after step KILL_AFTER (the first killed, torchrun ends the others, each after its 0.2 s).
Each step waits 20 ms for its data, then computes for 50 ms; a checkpoint after every 4th step; the
timer rewrites this process's progress object at every step's end (``progress_interval=0``). If REPO
holds a checkpoint, the run resumes from the newest, on record. After step KILL_AFTER (-1: never) it
works 0.2 s more and is killed (SIGKILL: nothing runs at exit, as when a node fails). LOG gets one
line per event, by this program's own clock: ``step STEP START_NS END_NS DATA_S`` (taken inside
``timer.step``: the timer's own work at a step's edges, its generators' digests and progress writes,
is the run's time between steps, as goodput counts it), ``save START_NS
END_NS``, ``resume NS``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import ckptfmt
import ckptfmt.saving.save  # the save machinery loaded at start, as a script's imports are


def main() -> None:
    repo, steps, kill_after, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        log = f"{log}.{dist.get_rank()}"
    with open(log, "a", buffering=1) as out:
        timer = ckptfmt.StepTimer(system_interval=None, progress_interval=0.0)
        model = torch.nn.Linear(4, 1)
        first = 0
        if os.path.exists(repo):
            newest = ckptfmt.Repository.open(repo).commits()[-1]
            url = f"{repo}/{newest.name}"
            state = ckptfmt.load(url)
            model.load_state_dict(state["model"])
            first = state["step"]
            ckptfmt.record_resume(url, {"model": model})
            out.write(f"resume {time.time_ns()}\n")
        for step in range(first, steps):
            with timer.step(step):
                start = time.time_ns()
                with timer.phase("data"):
                    began = time.perf_counter()
                    time.sleep(0.02)
                    waited = time.perf_counter() - began
                time.sleep(0.05)
                loss = model(torch.full((2, 4), float(step))).square().mean()
                timer.batch([step])
                end = time.time_ns()
            timer.metrics(loss=loss.detach())
            out.write(f"step {step} {start} {end} {waited}\n")
            if (step + 1) % 4 == 0:
                began_ns = time.time_ns()
                ckptfmt.save({"model": model.state_dict(), "step": step + 1}, f"{repo}/step-{step + 1:03d}",
                             step=step + 1, timer=timer)
                out.write(f"save {began_ns} {time.time_ns()}\n")
            if step == kill_after:
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGKILL)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
