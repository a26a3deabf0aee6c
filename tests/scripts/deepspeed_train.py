"""Train a tiny model with DeepSpeed on CPU and save a ZeRO checkpoint (run by test_import_deepspeed.py).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/scripts/deepspeed_train.py OUT STAGE DTYPE [STAGE DTYPE ...]

For each (stage, dtype) pair (dtype: fp32 or bf16; fp32-elastic also sets ZeRO's elastic_checkpoint,
bf16-fp32acc accumulates gradients in fp32, which makes ZeRO-1 DeepSpeed's BF16_Optimizer) it writes
OUT/z{stage}-{dtype}/ (a DeepSpeed checkpoint folder:
``latest`` + ``global_step3/``) and, from rank 0, OUT/z{stage}-{dtype}.expected.pt: what the live
engine holds, gathered with DeepSpeed's own API (fp32 master weight and Adam moments per
parameter), the module state dict and the step, for the test to compare the import against.
"""

import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from tests.support.deepspeed_start import init_distributed
from tests.support.deepspeed_teardown import destroy_process_groups, release_engine
from tests.support.exit_check import report_gloo_threads_at_exit

STEPS = 3


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(5, 7)      # odd sizes: partitions need padding
        self.frozen = torch.nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.second = torch.nn.Linear(7, 3)
        self.register_buffer("scale", torch.full((3,), 0.5))

    def forward(self, x):
        return self.second(torch.relu(self.frozen(torch.relu(self.first(x))))) * self.scale


def run(out: str, stage: int, dtype: str) -> None:
    torch.manual_seed(0)
    model = Tiny()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "elastic_checkpoint": dtype.endswith("-elastic")},
        "bf16": {"enabled": dtype.startswith("bf16")},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 10}},
        "steps_per_print": 1000,
    }
    if dtype.endswith("-fp32acc"):  # bf16 with fp32 gradient accumulation: ZeRO-1 runs as BF16_Optimizer
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(STEPS):
        x = torch.randn(2, 5, generator=generator).to(engine.module.first.weight.dtype)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    name = f"z{stage}-{dtype}"
    engine.save_checkpoint(f"{out}/{name}", client_state={"epoch": 1, "note": "tiny"})
    expected = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}, "global_steps": engine.global_steps}
    for pname, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        if stage == 0:  # no ZeRO optimizer: the torch optimizer's state is the parameter's own
            state = engine.optimizer.state[param] if dtype.startswith("fp32") else None
            if state is not None:
                expected["fp32"][pname] = param.detach().clone()
                expected["exp_avg"][pname] = state["exp_avg"].clone()
                expected["exp_avg_sq"][pname] = state["exp_avg_sq"].clone()
            continue
        expected["fp32"][pname] = safe_get_full_fp32_param(param).clone()
        expected["exp_avg"][pname] = safe_get_full_optimizer_state(param, "exp_avg").clone()
        expected["exp_avg_sq"][pname] = safe_get_full_optimizer_state(param, "exp_avg_sq").clone()
    if dist.get_rank() == 0:
        torch.save(expected, f"{out}/{name}.expected.pt")
    dist.barrier()
    release_engine(engine)


def main() -> None:
    out, rest = sys.argv[1], sys.argv[2:]
    init_distributed()
    for stage, dtype in zip(rest[::2], rest[1::2]):
        run(out, int(stage), dtype)
    destroy_process_groups()


if __name__ == "__main__":
    report_gloo_threads_at_exit()
    main()
