"""AdamW for pure-bf16 weights with stochastic rounding (`optim.implementation: bf16-stochastic`).

Why: a bf16 weight has 8 significant bits, so an update smaller than half its spacing rounds
away. One AdamW step (|update| = lr) on N(0, 0.02) weights stored in bf16 leaves 84 % of them
unchanged at lr 1e-5 (measured, README "70B on one node"): pure-bf16 training at fine-tuning
learning rates mostly does not train. Rounding the new weight up or down at random, with the
probability of each given by the distance to it, makes the stored weight right on average
(Gupta et al. 2015, "Deep learning with limited numerical precision"; Zamirai et al. 2020,
"Revisiting BFloat16 Training"), with no extra state (Kahan summation would need 2 B/param more).

torch has no such optimizer (torchao's `_AdamW(bf16_stochastic_round=True)` does it, a dependency
we do not otherwise need), so this is hand-written: the update is torch.optim.AdamW's
(`_single_tensor_adamw`: decoupled weight decay, bias-corrected moments, eps outside the sqrt),
computed in fp32 per tensor; m and v stay in the parameter's dtype as torch keeps them. On fp32
parameters nothing is rounded and the step equals torch's AdamW (tests/unit/test_optim.py).
Works on FSDP2's DTensor parameters (the states are DTensors like the params, for DCP; the
arithmetic runs on the local shards) and under ddp / zero1 (plain tensors).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardtune.parallel.build import build_strategy_optimizer
from shardtune.strategies import STRATEGY, resolve_optimizer_impl
from shardtune.train.core.metrics import local_tensor

if TYPE_CHECKING:
    from shardtune.config import OptimConfig, ParallelConfig


def stochastic_round_to_bf16_(x: torch.Tensor) -> torch.Tensor:
    """fp32 → bf16, rounding to one of the two neighbouring bf16 values with probability
    proportional to closeness: add 16 random low bits, then truncate (the low 16 bits of an fp32
    are what bf16 drops). E[result] = x for finite x. Overwrites `x` (contiguous fp32): one
    int32 temporary, the noise."""
    bits = x.view(torch.int32)
    bits.add_(torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device))
    return bits.bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)  # -65536 = 0xFFFF0000


class AdamWStochasticBF16(torch.optim.Optimizer):
    """torch.optim.AdamW's update in fp32, bf16 parameters written back by stochastic rounding."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # as torch AdamW: a CPU fp32 step counter, moments in the param dtype
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"].item()
                param, grad = local_tensor(p), local_tensor(p.grad)
                exp_avg, exp_avg_sq = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
                # copy=True: on fp32 tensors .float() would alias the state and the parameter
                denom = exp_avg_sq.to(torch.float32, copy=True).sqrt_().div_(bias_correction2_sqrt).add_(eps)
                new = param.to(torch.float32, copy=True).mul_(1 - lr * wd)
                new.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))  # fp32 += bf16/fp32
                del denom
                param.copy_(stochastic_round_to_bf16_(new) if param.dtype == torch.bfloat16 else new)
        return loss


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at 0-based `step`: linear warmup over `warmup_steps`, then cosine
    (SGDR, Loshchilov & Hutter 2017, without restarts) or linear decay to `min_lr_ratio`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


# torch AdamW's kernel per `optim.implementation` (plan/memory.py: each one's temporaries)
_IMPL_KWARGS = {"foreach": {"foreach": True}, "fused": {"fused": True},
                "for-loop": {"foreach": False}}  # bf16-stochastic: AdamWStochasticBF16


def build_optimizer(model: nn.Module, optim_cfg: OptimConfig, parallel_cfg: ParallelConfig,
                    dp_group=None) -> torch.optim.Optimizer:
    """AdamW over the trainable params: torch's (kernel per `optim.implementation`; auto: fused) or
    an 8-bit AdamW (`optim.name` adamw-8bit: torchao's under FSDP strategies, bitsandbytes' under ddp/zero1);
    the strategy holds its states (zero1: sharded across `dp_group`, `build_strategy_optimizer`)."""
    kwargs = dict(lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps,
                  weight_decay=optim_cfg.weight_decay)
    if optim_cfg.name == "adamw-8bit" and STRATEGY[parallel_cfg.strategy].fsdp:
        from torchao.optim import AdamW8bit  # noqa: PLC0415 optional dependency (`8bit` extra): imported on use

        cls = AdamW8bit  # takes FSDP2's DTensor params: states quantised per local shard
        # pure bf16 weights: its own stochastic rounding, as bf16-stochastic does for torch's AdamW
        kwargs["bf16_stochastic_round"] = parallel_cfg.precision == "bf16"
    elif optim_cfg.name == "adamw-8bit":
        import bitsandbytes as bnb  # noqa: PLC0415 optional dependency (`8bit` extra): imported on use

        cls = bnb.optim.AdamW8bit
    elif optim_cfg.implementation == "bf16-stochastic":
        cls = AdamWStochasticBF16
    else:
        cls = torch.optim.AdamW
        impl = resolve_optimizer_impl(optim_cfg.implementation)
        kwargs.update(_IMPL_KWARGS[impl])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_strategy_optimizer(parallel_cfg, cls, params, dp_group, **kwargs)
    if type(optimizer).__module__.startswith("torchao"):
        optimizer.register_load_state_dict_post_hook(_tensor_lr)
    return optimizer


def _tensor_lr(optimizer) -> None:
    """After a load: torchao's optimizers need each group's lr as a tensor (their compiled step
    refuses a float), and a checkpoint's param groups come back with plain numbers."""
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)


def _plain(v):
    """A 0-dim tensor (or a list of them) as Python floats."""
    if isinstance(v, torch.Tensor):
        return float(v)
    return [_plain(x) for x in v] if isinstance(v, list) else v


class _LambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """torch's LambdaLR whose state_dict holds plain numbers: torchao's optimizers (adamw-8bit
    under FSDP) keep each group's lr as a tensor, so base_lrs and _last_lr become tensors, and the
    checkpoint writes the scheduler's state as JSON (train/durable/checkpoint.py). Loading floats
    back is exact: the scheduler fills the tensor lr in place (`_update_param_group_val`)."""

    def state_dict(self) -> dict:
        return {k: _plain(v) for k, v in super().state_dict().items()}


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg: OptimConfig, total_steps: int):
    """torch LambdaLR over `lr_factor`."""
    def factor(step: int) -> float:
        return lr_factor(step, optim_cfg.warmup_steps, total_steps, optim_cfg.schedule, optim_cfg.min_lr_ratio)

    return _LambdaLR(optimizer, factor)
