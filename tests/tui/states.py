"""Training states the TUI tests save: small ones with fixed seeds, built in each test's tmp_path."""

from __future__ import annotations

import torch

#: GPT-2's per-layer tensors, under transformer.h.N.
GPT2_LAYER = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
              "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
              "mlp.c_proj.weight", "mlp.c_proj.bias")


def model_state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "embed.weight": torch.randn(8, 4, generator=generator),
            "layers.0.attn.q_proj.weight": torch.randn(4, 4, generator=generator),
            "layers.0.attn.k_proj.weight": torch.randn(4, 4, generator=generator),
            "layers.1.attn.q_proj.weight": torch.randn(4, 4, generator=generator),
            "head.bias": torch.tensor([0.0, 1.0, float("nan"), float("inf")]),
        },
        "step": seed,
    }


def gpt2_state() -> dict:
    """A 12-layer GPT-2's tensor keys (tiny tensors, seeded): ``model/transformer.h.11.mlp.c_proj.weight``,
    and an EMA copy of layer 11's attention as nested maps (``ema/transformer/h/11/attn/c_attn/bias``);
    the optimizer's learning rate, 3e-4, is a plain value."""
    generator = torch.Generator().manual_seed(0)
    model = {f"transformer.{name}": torch.randn(16, 4, generator=generator) for name in ("wte.weight", "wpe.weight")}
    for layer in range(12):
        for name in GPT2_LAYER:
            shape = (4,) if name.endswith("bias") else (4, 4)
            model[f"transformer.h.{layer}.{name}"] = torch.randn(shape, generator=generator)
    attention = {part: {"weight": torch.randn(4, 4, generator=generator), "bias": torch.randn(4, generator=generator)}
                 for part in ("c_attn", "c_proj")}
    return {"model": model, "ema": {"transformer": {"h": {"11": {"attn": attention}}}},
            "optimizer": {"param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95)}]}}


def gpt2_trained(state: dict) -> dict:
    """``state`` after a step: one weight of the last layer and its EMA moved, the learning rate decayed."""
    state["model"]["transformer.h.11.mlp.c_proj.weight"] += 1.0
    state["ema"]["transformer"]["h"]["11"]["attn"]["c_attn"]["bias"] += 0.01
    state["optimizer"]["param_groups"][0]["lr"] = 1e-4
    return state
