"""End a DeepSpeed test program so that no gloo group outlives ``destroy_process_group``.

Three things held DeepSpeed's groups until the interpreter's shutdown, where a group's worker
threads can abort the process (tests/support/exit_check.py says how), each found with that check:

- ``torch.distributed.nn``'s functions take ``group=group.WORLD`` as a default argument, evaluated
  on import; DeepSpeed imports the module after ``init_process_group``, so the defaults hold the
  world group for good. Importing this module first imports it before init: the default is None.
- ZeRO-3 pushes the model onto ``parameter_offload.FWD_MODULE_STACK`` when it sets up and never
  takes it off, and its parameter coordinator's ``__params_to_release`` is an ``lru_cache`` on the
  class, keyed by the coordinator and the modules: both keep the model, whose hooks hold the
  engine, which holds the groups. ``engine.destroy()`` releases neither.
- With bf16 and fp32 gradient accumulation, the parameters outlive the engine (held from C++,
  where the collector cannot see), and each keeps its data-parallel group as ``_dp_group``.
- A group is left in a reference cycle: ``gc.collect()`` after the groups are destroyed frees it.
"""

from __future__ import annotations

import gc

import torch.distributed.nn  # imported before init_process_group: see above


def release_engine(engine) -> None:
    """Let go of what a DeepSpeed engine holds, so that it and its groups can be freed."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    for parameter in engine.module.parameters():
        for name, value in list(vars(parameter).items()):
            if isinstance(value, torch.distributed.ProcessGroup):
                delattr(parameter, name)
    engine.destroy()
    parameter_offload.FWD_MODULE_STACK.clear()
    params_to_release = PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
    for cell in params_to_release.__closure__ or ():  # the lru_cache, under DeepSpeed's nvtx wrapper
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()


def destroy_process_groups() -> None:
    """Destroy every group, drop DeepSpeed's references to them and free them now."""
    import deepspeed.comm

    deepspeed.comm.destroy_process_group()
    gc.collect()
