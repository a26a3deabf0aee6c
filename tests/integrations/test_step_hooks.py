"""The step hooks of the integrations without a loop callback (Accelerate, torchtitan): each step's output
is signed by the norm of the gradients the optimizers step with, after the loop's clipping."""

from __future__ import annotations

import torch

from ckptfmt.integrations.step_hooks import HookedStepTimer, local_gradient_norm
from ckptfmt.metadata.step_timer import decode_steps


def run(model, optimizers, clip: float | None, steps: int = 3) -> list[float]:
    """Train ``steps`` steps; the norm of the gradients each step stepped with (after clipping)."""
    norms = []
    data = torch.randn(steps, 4, 8, generator=torch.Generator().manual_seed(0))
    for batch in data:
        model(batch).square().mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return norms


def test_each_step_is_signed_by_the_norm_of_the_gradients_it_stepped_with():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 1))
    # two optimizers over the model's parts: one norm over both, taken when the first steps
    optimizers = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1)]
    timing = HookedStepTimer([model], optimizers)
    norms = run(model, optimizers, clip=0.01)
    recorded = _recorded(timing)
    assert recorded == norms and all(abs(norm - 0.01) < 1e-6 for norm in norms)  # clipped: the signature shows it


def test_sign_gradients_off_records_no_norm():
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    timing = HookedStepTimer([model], [optimizer], sign_gradients=False)
    run(model, [optimizer], clip=None)
    assert _recorded(timing) is None


def _recorded(timing: HookedStepTimer) -> list[float] | None:
    """The ``grad_norm_local`` metric of the steps the timer holds, as they would be stored."""
    columns = decode_steps(timing.timer.snapshot(), "test")
    values = columns.metrics.get("grad_norm_local")
    return None if values is None else values.tolist()


def test_the_norm_is_get_total_norms_for_one_dtype_and_for_several():
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 1))
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert torch.equal(local_gradient_norm([optimizer]), expected)
    model[1].to(torch.bfloat16)
    model[1].weight.grad = torch.randn_like(model[1].weight)
    model[1].bias.grad = torch.randn_like(model[1].bias)
    mixed = local_gradient_norm([optimizer])
    assert torch.equal(mixed, torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    assert local_gradient_norm([torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)]) is None
