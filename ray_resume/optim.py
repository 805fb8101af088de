"""The optimizer step: any torch.optim optimizer, fp32 main params, gradient clipping, dynamic loss scale.

With `model.dtype: bfloat16 | float16` the model computes in that dtype while
the optimizer (`training.optimizer`, AdamW by default) steps fp32 copies of
the parameters ("main params", as in Megatron);
after each step the main params are copied back into the model. float16
adds a dynamic loss scaler: grow after `growth_interval` clean steps, back
off and skip the step on inf/nan gradients. With float32 the model's own
params are the main params and the loss scale stays 1.0. `grad_clip` scales
the gradients down to that global norm before the step (after unscaling, on
the main params, so DDP, FSDP2 shards and gradient accumulation all see the
norm of the whole step's gradient).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .checkpoint.format import names
from .checkpoint.format.state import dim0_sharded, load_optim_tensors, local_tensor, optim_tensors, unwrap


class LossScaler:
    def __init__(
        self, scale: float = 2.0**16, growth_interval: int = 1000, factor: float = 2.0, min_scale: float = 1.0
    ):
        self.scale = scale
        self.growth_interval = growth_interval
        self.factor = factor
        self.min_scale = min_scale
        self.clean_steps = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.scale / self.factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.factor

    def state(self) -> dict:
        return {"loss_scale": self.scale, "loss_scale_clean_steps": self.clean_steps}

    def load(self, common: dict) -> None:
        self.scale = float(common["loss_scale"])
        self.clean_steps = int(common.get("loss_scale_clean_steps", 0))


def optimizer_kwargs(cls: type, weight_decay: float, args: dict[str, Any] | None) -> dict[str, Any]:
    """The keyword arguments `cls` is built with besides lr: `args`, and weight_decay where it takes one."""
    try:
        takes = "weight_decay" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        takes = True
    if weight_decay and not takes:
        raise TypeError(f"{cls.__name__} takes no weight_decay; set training.weight_decay: 0")
    return {**({"weight_decay": weight_decay} if takes else {}), **(args or {})}


class MainParamsOptimizer:
    """A torch.optim optimizer (AdamW by default) over fp32 main params that shadow a (possibly) low-precision model."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float = 0.0,
        optimizer_class: type = torch.optim.AdamW,
        optimizer_args: dict[str, Any] | None = None,
        grad_clip: float = 0.0,
    ):
        self.model = model
        self.named = list(unwrap(model).named_parameters())
        self.mixed = any(p.dtype != torch.float32 for _, p in self.named)
        if self.mixed:
            self.main = [p.detach().float().clone().requires_grad_(True) for _, p in self.named]
        else:
            self.main = [p for _, p in self.named]
        self.optimizer = optimizer_class(
            self.main, lr=lr, **optimizer_kwargs(optimizer_class, weight_decay, optimizer_args)
        )
        self.grad_clip = grad_clip
        self.scaler = LossScaler() if any(p.dtype == torch.float16 for _, p in self.named) else None
        self.grad_norm = float("nan")  # of the last step's (unscaled) gradients, for the curves

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.loss_scale).backward()

    def step(self) -> bool:
        """One optimizer step; False when fp16 gradients overflowed and the step was skipped."""
        if self.mixed:
            for main, (_, p) in zip(self.main, self.named):
                main.grad = None if p.grad is None else p.grad.float() / self.loss_scale
        self.grad_norm = grad_norm(self.main)
        if self.scaler:
            finite = all(torch.isfinite(local_tensor(m.grad)).all() for m in self.main if m.grad is not None)
            finite_flag = torch.tensor([1.0 if finite else 0.0], device=self.main[0].device)
            if torch.distributed.is_initialized():  # every rank must agree to skip
                torch.distributed.all_reduce(finite_flag, op=torch.distributed.ReduceOp.MIN)
            finite = bool(finite_flag.item())
            self.scaler.update(finite)
            if not finite:
                return False
        if self.grad_clip and self.grad_norm > self.grad_clip:
            # torch.nn.utils.clip_grad_norm_'s coefficient, from the norm of the whole (all-reduced or sharded) gradient
            scale = self.grad_clip / (self.grad_norm + 1e-6)
            for main in self.main:
                if main.grad is not None:
                    main.grad.mul_(scale)
        self.optimizer.step()
        if self.mixed:
            with torch.no_grad():
                for main, (_, p) in zip(self.main, self.named):
                    p.copy_(main)
        return True

    def reload_main_params_from_model(self) -> None:
        """After a weights-only load: start the fp32 main params from the loaded model, not from the init."""
        if self.mixed:
            with torch.no_grad():
                for main, (_, p) in zip(self.main, self.named):
                    main.copy_(p.float())

    def named_main(self) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, the tensor AdamW steps): the fp32 main param, or the param itself in fp32."""
        return [(name, main) for main, (name, _) in zip(self.main, self.named)]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Name-keyed optimizer slots, plus the fp32 main params (`main_param.{param}`) when they shadow the model."""
        out = optim_tensors(self.named_main(), self.optimizer)
        if self.mixed:
            out.update({names.state_name(name, names.MAIN_PARAM): main.detach() for name, main in self.named_main()})
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        mains = {k for k in tensors if names.parse_state_name(k)[1] == names.MAIN_PARAM}
        load_optim_tensors(self.named_main(), self.optimizer, {k: v for k, v in tensors.items() if k not in mains})
        if self.mixed:
            with torch.no_grad():
                for name, main in self.named_main():
                    local = local_tensor(main)  # this rank's shard under FSDP
                    local.copy_(tensors[names.state_name(name, names.MAIN_PARAM)].view(local.shape))


def grad_norm(params) -> float:
    """The global L2 norm of the parameters' gradients, in float64 beside the training math (it
    changes nothing there). FSDP2 shards are summed over the group; replicated ones count once."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    squares = {True: 0.0, False: 0.0}
    for g in grads:
        # One float32 reduction per tensor, no full-size copy at the step's memory peak.
        squares[dim0_sharded(g)] += (
            torch.linalg.vector_norm(local_tensor(g).detach(), dtype=torch.float32).double() ** 2
        )
    sharded = torch.as_tensor(squares[True], dtype=torch.float64, device=local_tensor(grads[0]).device)
    if any(dim0_sharded(g) for g in grads) and torch.distributed.is_initialized():
        torch.distributed.all_reduce(sharded)
    return float((sharded + squares[False]).sqrt())
