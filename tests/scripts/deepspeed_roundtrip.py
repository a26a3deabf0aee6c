"""Save ZeRO checkpoints with DeepSpeed on CPU, and load exported ones back (run by test_export_deepspeed.py).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node N tests/scripts/deepspeed_roundtrip.py save OUT NAME:STAGE:DTYPE ...
    DS_ACCELERATOR=cpu torchrun --nproc_per_node N tests/scripts/deepspeed_roundtrip.py load OUT DIR:STAGE:DTYPE ...

DTYPE is fp32, bf16, fp16 or fp32-elastic (ZeRO's elastic_checkpoint layout).

``save`` trains the model 3 steps per configuration and saves OUT/NAME (a DeepSpeed
checkpoint folder); ``load`` builds a fresh engine for that stage and dtype on N ranks,
calls DeepSpeed's own ``load_checkpoint(OUT/DIR)``, then trains one more step. Both write
OUT/<NAME or DIR>.state.pt from rank 0: what the engine holds, gathered with DeepSpeed's API
(fp32 master weight and Adam moments per parameter, the module's weights, step, scheduler,
client state; ``load`` adds the loss of the extra step), for the test to compare bit for bit.
The model has odd sizes (partitions need padding), a frozen layer, a buffer, a tied weight
and two optimizer groups (weight decay on matrices only).
"""

import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from tests.support.deepspeed_start import init_distributed
from tests.support.deepspeed_teardown import destroy_process_groups, release_engine
from tests.support.exit_check import report_gloo_threads_at_exit


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 5)
        self.first = torch.nn.Linear(5, 7)
        self.frozen = torch.nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.second = torch.nn.Linear(7, 5)
        self.head = torch.nn.Linear(5, 11, bias=False)
        self.head.weight = self.embed.weight  # tied: DeepSpeed records it in shared_params
        self.register_buffer("scale", torch.full((11,), 0.5))

    def forward(self, tokens):
        h = self.second(torch.relu(self.frozen(torch.relu(self.first(self.embed(tokens))))))
        return self.head(h) * self.scale


def allow_fp16_on_cpu() -> None:
    """DeepSpeed's CPU accelerator offers fp16 only where oneDNN has fp16 kernels, which most CPUs
    lack; the tiny model trains in fp16 on any CPU, and the files' layout is what is tested."""
    accelerator = type(get_accelerator())
    accelerator.is_fp16_supported = lambda self: True
    accelerator.supported_dtypes = lambda self: [torch.float, torch.bfloat16, torch.float16]


def engine_for(stage: int, dtype: str):
    if dtype == "fp16":
        allow_fp16_on_cpu()
    torch.manual_seed(0)
    model = Model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "elastic_checkpoint": dtype == "fp32-elastic"},
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 10}},
        "steps_per_print": 1000,
    }
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in trainable if p.dim() > 1], "weight_decay": 0.01},
              {"params": [p for n, p in trainable if p.dim() <= 1], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train_step(engine, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    tokens = torch.randint(0, 11, (2, 3), generator=generator)
    loss = engine(tokens).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def snapshot(engine, stage: int, client_state) -> dict:
    """What the engine holds, whole, per parameter (collective: every rank calls it)."""
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19 links optimizer-state fragments after the first group's first step, before
        # the other groups have state: link again so safe_get_full_optimizer_state sees every group
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    state = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}, "global_steps": engine.global_steps,
             "lr_scheduler": engine.lr_scheduler.state_dict(), "client_state": client_state, "module": {}}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            state["fp32"][name] = safe_get_full_fp32_param(param).clone()
            state["exp_avg"][name] = safe_get_full_optimizer_state(param, "exp_avg").clone()
            state["exp_avg_sq"][name] = safe_get_full_optimizer_state(param, "exp_avg_sq").clone()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        state["module"] = {k: v.clone() for k, v in engine.module.state_dict().items()}
    state["lr"] = [group["lr"] for group in engine.optimizer.optimizer.param_groups]
    return state


def main() -> None:
    mode, out, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
    init_distributed()
    for spec in specs:
        name, stage, dtype = spec.split(":")
        stage = int(stage)
        engine = engine_for(stage, dtype)
        if mode == "save":
            for step in range(3):
                train_step(engine, step)
            client = {"epoch": 1, "note": "tiny"}
            engine.save_checkpoint(f"{out}/{name}", client_state=client)
            state = snapshot(engine, stage, client)
        else:
            _, client = engine.load_checkpoint(f"{out}/{name}")
            state = snapshot(engine, stage, client)
            state["next_loss"] = train_step(engine, 7)
            state["after"] = snapshot(engine, stage, client)["fp32"]
        if dist.get_rank() == 0:
            torch.save(state, f"{out}/{name}.state.pt")
        dist.barrier()
        release_engine(engine)
        del engine  # before the groups are destroyed and collected
    destroy_process_groups()


if __name__ == "__main__":
    report_gloo_threads_at_exit()
    main()
