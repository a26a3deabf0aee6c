"""Step timing from torch's own hooks, for frameworks whose training loop offers no callbacks
(Accelerate, torchtitan): a forward pre-hook on each model and step hooks on each optimizer.

A step runs from the end of the previous one to the end of its optimizer steps (every optimizer
stepped once), in phases ``data`` (until the first forward in training mode: fetching the batch
and whatever the loop did in between), ``forward_backward`` and ``optimizer``. Gradient
accumulation's micro-batches fall in one step, as their forwards come before the optimizer's step.
Each step is signed (spec 9.4): the generators' digests at its start, its batch by the first
model's inputs, every training forward's (micro-batches in order), and its output by
``grad_norm_local``: the 2-norm of the gradients this rank's optimizers are about to step with (its
shards of them; after any clipping), taken when the first optimizer steps. The loss is the loop's
(``timer.metrics(loss=...)``): no hook sees it, but the gradients are its image, and the gradients
after clipping show a changed clipping norm at the step it changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckptfmt.metadata.step_timer import StepTimer


class HookedStepTimer:
    """Times every training step of this rank into ``self.timer``.

    ``step_number`` gives the number of the step that starts now (default: steps counted from 0,
    ``steps_started``, which a resumed run sets back). ``sign_gradients``: record each step's
    ``grad_norm_local`` (one reduction over the rank's gradients a step, as gradient clipping does;
    on a GPU it stays there until the steps are stored).
    """

    def __init__(self, models: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer],
                 step_number: Callable[[], int] | None = None, *, sign_gradients: bool = True):
        self.timer = StepTimer()
        self.steps_started = 0
        self._step_number = step_number or (lambda: self.steps_started)
        optimizers = list(optimizers)
        self._optimizers = {id(o) for o in optimizers}
        self._signed_optimizers = optimizers if sign_gradients else []
        self._stepped: set[int] = set()
        self._since: int | None = None
        #: Work for when the next training step begins (``at_next_step``).
        self._pending: list[Callable[[], object]] = []
        models = list(models)
        self._handles = [model.register_forward_pre_hook(self._forward) for model in models]
        if models:  # the first model's inputs are the batch (a pipeline's later stages take activations)
            self._handles.append(models[0].register_forward_pre_hook(self._batch, with_kwargs=True))
        for optimizer in optimizers:
            self._handles += [optimizer.register_step_pre_hook(self._before_step),
                              optimizer.register_step_post_hook(self._after_step)]

    def at_next_step(self, work: Callable[[], object]) -> None:
        """Run ``work`` when the next training step begins, before it is timed (or at ``run_pending``):
        a resume's record of what the loop's own code left in place by then."""
        self._pending.append(work)

    def run_pending(self) -> None:
        """Run the work left for the next step now (a save before any step)."""
        pending, self._pending = self._pending, []
        for work in pending:
            work()

    def remove(self) -> None:
        """Take the hooks off; the timer keeps the steps it has."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _forward(self, module: torch.nn.Module, args: Any) -> None:
        """A forward in training mode outside a step starts one; ``data`` comes first even in the
        first step (analyses take phases to run in the order the timer first saw them)."""
        if module.training and not self.timer.in_step:
            if self._pending:
                self.run_pending()
                self._since = time.perf_counter_ns()  # the work is the resume's, not the step's data wait
            self.timer.start_step(self._step_number(), since_ns=self._since, phase="data")
            self.timer.mark("forward_backward")
            self._stepped.clear()

    def _batch(self, module: torch.nn.Module, args: Any, kwargs: dict) -> None:
        """Each training forward's inputs go into the step's batch digest (its signature), micro-batches
        in order."""
        if module.training and self.timer.in_step:
            self.timer.batch_tensors((args, kwargs))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.timer.in_step:
            if not self._stepped and self._signed_optimizers:
                norm = local_gradient_norm(self._signed_optimizers)
                if norm is not None:
                    self.timer.metrics(grad_norm_local=norm)
            self.timer.mark("optimizer")

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.timer.in_step:
            return  # not a training step's (torch initialising an optimizer's state for a load)
        self._stepped.add(id(optimizer))
        if self._stepped >= self._optimizers:
            self.timer.end_step()
            self.steps_started += 1
            self._since = time.perf_counter_ns()
        else:
            self.timer.mark("forward_backward")  # the next optimizer's forward and backward


@torch.no_grad()
def local_gradient_norm(optimizers: Iterable[torch.optim.Optimizer]) -> torch.Tensor | None:
    """The 2-norm of the gradients of ``optimizers``' parameters that this rank holds (a DTensor's
    local shard), as ``torch.nn.utils.get_total_norm`` computes it: a one-element tensor on the
    gradients' device, in their dtype; None where no parameter has a gradient."""
    gradients = [parameter.grad.to_local() if isinstance(parameter.grad, DTensor) else parameter.grad
                 for optimizer in optimizers for group in optimizer.param_groups for parameter in group["params"]
                 if parameter.grad is not None]
    if not gradients:
        return None
    first = gradients[0]
    if all(gradient.device == first.device and gradient.dtype == first.dtype for gradient in gradients):
        # get_total_norm's own computation for one device and dtype, without its grouping (half its time
        # on a small model's few gradients: 10 us a step instead of 20 here)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gradients)))
    return torch.nn.utils.get_total_norm(gradients, 2.0)
