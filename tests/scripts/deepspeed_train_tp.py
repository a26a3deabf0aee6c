"""Train a tiny tensor-parallel model with DeepSpeed on 4 CPU ranks (mp=2 x dp=2) and save checkpoints.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 tests/scripts/deepspeed_train_tp.py OUT STAGE DTYPE [STAGE DTYPE ...]

Run by test_import_deepspeed_tp.py. Ranks are laid out Megatron-style (the two model-parallel
ranks of a data-parallel rank are consecutive) and handed to DeepSpeed through a small ``mpu``.
The model has a column-parallel linear (weight and bias split on dim 0), a row-parallel linear
(weight split on dim 1), a replicated LayerNorm, and an embedding tied to the output head
(replicated): the split layers start from values seeded by the model-parallel rank, the
replicated ones from the same seed, and the replicated ones only see a loss term that is
the same on every model-parallel rank, so they stay identical. The optimizer has two groups
(weight decay for matrices, none for biases and the LayerNorm).

For each (stage, dtype) (dtype fp32 or bf16, stage 0 fp32 only; a ``-uci`` suffix attaches Megatron-DeepSpeed's
``universal_checkpoint_info`` to the module) it writes OUT/z{stage}-{dtype}/ (``latest`` +
``global_step3/``) and, from the data-parallel rank 0 of each model-parallel rank r,
OUT/z{stage}-{dtype}.mp{r}.expected.pt: the rank's fp32 master weights and Adam moments per
parameter, gathered with DeepSpeed's safe_get_full_* API.
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
MP = 2
#: what Megatron-DeepSpeed would attach to its module (names as in deepspeed/checkpoint/constants.py)
UNIVERSAL_INFO = {
    "universal_checkpoint_version": 0.2,
    "tp_replicated_parameter_patterns": [r"norm\.", r"embed\.weight$"],
    "parameter_with_row_parallelism_patterns": [r"row\.weight$"],
}


class Mpu:
    """The model-/data-parallel groups DeepSpeed asks an ``mpu`` for (rank = dp * MP + mp)."""

    def __init__(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        self.mp_rank, self.dp_rank, self.dp_size = rank % MP, rank // MP, world // MP
        for dp in range(self.dp_size):  # every rank creates every group, in the same order
            group = dist.new_group([dp * MP + m for m in range(MP)])
            if dp == self.dp_rank:
                self.mp_group = group
        for mp in range(MP):
            ranks = [d * MP + mp for d in range(self.dp_size)]
            group = dist.new_group(ranks)
            if mp == self.mp_rank:
                self.dp_group, self.dp_ranks = group, ranks

    def get_model_parallel_rank(self):
        return self.mp_rank

    def get_model_parallel_world_size(self):
        return MP

    def get_model_parallel_group(self):
        return self.mp_group

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp_size

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self):
        return self.dp_ranks


class TinyTP(torch.nn.Module):
    def __init__(self, mp_rank: int):
        super().__init__()
        torch.manual_seed(0)  # replicated: the same on every rank
        self.embed = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.full((6,), 0.5))
        torch.manual_seed(100 + mp_rank)  # split: this model-parallel rank's shards
        self.col = torch.nn.Linear(6, 10 // MP)              # column-parallel: [5, 6] + [5] per rank
        self.row = torch.nn.Linear(10 // MP, 6, bias=False)  # row-parallel: [6, 5] per rank

    def forward(self, tokens):
        x = self.embed(tokens)
        replicated = self.head(self.norm(x)).float().pow(2).mean()  # the same on every mp rank
        split = self.row(torch.relu(self.col((x.detach() * self.scale).to(x.dtype)))).float().pow(2).mean()
        return replicated + split


def groups(model: torch.nn.Module) -> list:
    decay = [model.embed.weight, model.col.weight, model.row.weight]
    no_decay = [model.norm.weight, model.norm.bias, model.col.bias]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def run(out: str, mpu: Mpu, stage: int, dtype: str) -> None:
    model = TinyTP(mpu.mp_rank)
    if dtype.endswith("-uci"):
        model.universal_checkpoint_info = UNIVERSAL_INFO
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype.startswith("bf16")},
        "steps_per_print": 1000,
    }
    optimizer = torch.optim.Adam(groups(model), lr=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    generator = torch.Generator().manual_seed(1 + mpu.dp_rank)  # the same batch on both mp ranks
    for _ in range(STEPS):
        loss = engine(torch.randint(0, 11, (2, 3), generator=generator))
        engine.backward(loss)
        engine.step()
    name = f"z{stage}-{dtype}"
    engine.save_checkpoint(f"{out}/{name}", client_state={"epoch": 1})
    if stage in (1, 2):
        # DeepSpeed links each parameter to its Adam state after the first group's first step, before
        # the other groups have state: link again now, or safe_get_full_optimizer_state fails on them
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    expected = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for pname, param in engine.module.named_parameters():
        if stage == 0:  # no ZeRO optimizer (fp32 only): the torch optimizer's state is the parameter's own
            expected["fp32"][pname] = param.detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                expected[key][pname] = engine.optimizer.state[param][key].clone()
            continue
        expected["fp32"][pname] = safe_get_full_fp32_param(param).clone()
        expected["exp_avg"][pname] = safe_get_full_optimizer_state(param, "exp_avg").clone()
        expected["exp_avg_sq"][pname] = safe_get_full_optimizer_state(param, "exp_avg_sq").clone()
    if mpu.dp_rank == 0:
        torch.save(expected, f"{out}/{name}.mp{mpu.mp_rank}.expected.pt")
    dist.barrier()
    release_engine(engine)


def main() -> None:
    out, rest = sys.argv[1], sys.argv[2:]
    init_distributed()
    mpu = Mpu()
    for stage, dtype in zip(rest[::2], rest[1::2]):
        run(out, mpu, int(stage), dtype)
    destroy_process_groups()


if __name__ == "__main__":
    report_gloo_threads_at_exit()
    main()
