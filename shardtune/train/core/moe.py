"""Mixture-of-experts models in the step: transformers' own classes (MixtralForCausalLM,
Qwen3MoeForCausalLM), experts as 3-D parameters run by one grouped GEMM per layer
(`experts_implementation="grouped_mm"`), the router in fp32, and the load-balancing auxiliary loss
over the global batch (docs/moe.md).

The auxiliary loss is Switch Transformer's (Fedus et al. 2021, eqs. 4-6), as transformers'
`load_balancing_loss_func` pools it over layers: aux = E · Σ_e f_e · P_e, f_e the fraction of
top-k assignments to expert e, P_e its mean router probability, both over every layer's rows. It
is a product of two means, so a rank's own aux is not its share of the global one; here f comes
from counts summed over the ranks routing different tokens (the data ranks; with tp or cp every
rank: parallel/ep.py `mark_routing`), one all-reduce of L·E + 1 floats per micro-batch, no
gradient through it, and each rank adds E · Σ_e f_e · (its probability sum) / N:
the ranks' parts sum to the aux of the whole micro-batch, and so does its gradient.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from shardtune.parallel.ep import ROUTING_ATTR

EXPERTS_IMPLEMENTATION = "grouped_mm"  # one grouped GEMM per layer (torch's grouped_mm), no loop over experts


def num_experts(config) -> int:
    """Routed experts per MoE layer (0 for a dense model): Mixtral's num_local_experts, Qwen3-MoE's
    and GPT-OSS's num_local_experts / num_experts, DeepSeek's n_routed_experts."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if int(getattr(config, key, 0) or 0) > 0:
            return int(getattr(config, key))
    return 0


def routers(model: nn.Module) -> list[nn.Module]:
    """The top-k routers, in layer order (MixtralTopKRouter, Qwen3MoeTopKRouter, ...)."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


def _fp32_router_forward(router: nn.Module, hidden_states: torch.Tensor):
    """transformers' top-k router (logits, renormalised top-k weights, indices; GPT-OSS: its bias and its
    softmax over the top-k logits, which equals the renormalised top-k probabilities) with the logits and
    softmax in fp32 whatever the compute dtype: a bf16 router picks experts from rounded logits,
    and near-ties flip (Megatron's `moe_router_dtype=fp32`, torchtitan's router does the same).
    In fp32 it is transformers' forward, bit for bit."""
    with torch.autocast(hidden_states.device.type, enabled=False):
        hidden = hidden_states.reshape(-1, router.hidden_dim).float()  # (N, h)
        bias = getattr(router, "bias", None)  # GPT-OSS's router has one
        logits = F.linear(hidden, _local(router.weight).float(), None if bias is None else _local(bias).float())
        if bias is not None:  # GPT-OSS: top-k of the logits, softmax over those k (transformers' order)
            top, index = torch.topk(logits, router.top_k, dim=-1)
            return logits, torch.softmax(top, dim=1), index
        probs = torch.softmax(logits, dim=-1)
        top, index = torch.topk(probs, router.top_k, dim=-1)  # (N, k)
        if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises; Qwen3-MoE as configured
            top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, index


def attention_implementation(config) -> str:
    """transformers' attention the trainer asks for: SDPA, except GPT-OSS, whose attention sinks
    (one learned logit per head in the softmax's denominator) SDPA has no term for, and whose class
    refuses SDPA: its eager attention (the (s, s) scores held in memory)."""
    return "eager" if getattr(config, "model_type", None) == "gpt_oss" else "sdpa"


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The router weight as this rank uses it: under tp (parallel/tp.py) a Replicate DTensor whose
    rank routes its own tokens, so its gradient here is a partial sum over the tp ranks (FSDP sums it)."""
    if isinstance(weight, DTensor):
        return weight.to_local(grad_placements=(Partial(),))
    return weight


def prepare_moe(model: nn.Module) -> None:
    """Each router computes in fp32 (in place; names and state-dict keys unchanged)."""
    for router in routers(model):
        router.forward = _fp32_router_forward.__get__(router)


@contextmanager
def record_routing(model: nn.Module):
    """Within the block, each router's forward appends (logits (N, E), top-k indices (N, k)) to the
    list yielded (None for a dense model). Only the forward inside the block records: an
    activation-checkpoint recompute in backward runs after it, unseen."""
    found = routers(model)
    if not found:
        yield None
        return
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = [r.register_forward_hook(lambda _m, _a, out: seen.append((out[0], out[2]))) for r in found]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def aux_loss_part(seen: list[tuple[torch.Tensor, torch.Tensor]], num_experts: int, group=None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's part of the micro-batch's global load-balancing loss (0-dim fp32, with
    gradient; the parts sum over `group` to transformers' `load_balancing_loss_func` of the whole
    micro-batch), the global top-k assignments per layer and expert (L, E), no gradient)."""
    num_layers = len(seen)
    counts = torch.stack([torch.bincount(index.flatten(), minlength=num_experts)[:num_experts]
                          for _, index in seen]).to(torch.float64)  # (L, E)
    rows = torch.tensor([float(sum(logits.shape[0] for logits, _ in seen))], dtype=torch.float64,
                        device=counts.device)
    both = torch.cat([counts.flatten(), rows])
    if group is not None or (dist.is_available() and dist.is_initialized()):
        dist.all_reduce(both, group=group)
    counts, total_rows = both[:-1].view(num_layers, num_experts), both[-1]
    f = (counts.sum(0) / total_rows).float()  # (E,): assignments per row over all layers' rows
    prob_sum = sum(torch.softmax(logits.float(), dim=-1).sum(0) for logits, _ in seen)  # (E,)
    return num_experts * (f * prob_sum / total_rows.float()).sum(), counts


def load_cv(counts: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation of the tokens per expert (std / mean over every (layer, expert)
    pair: each layer routes the same tokens, so 0 is perfect balance)."""
    counts = counts.double()
    return counts.std(unbiased=False) / counts.mean().clamp(min=1e-12)


class MoeTerms:
    """The MoE terms of one step (nothing for a dense model): each micro-batch's load-balancing
    loss, weighted by the model's `router_aux_loss_coef` and averaged over the micro-batches, added
    to the objective; `parts` gives the step's `aux_loss` (the mean of the micro-batches' global aux
    losses) and `expert_load_cv` (over the step's global tokens) as metrics.jsonl parts."""

    def __init__(self, model: nn.Module, num_micro_batches: int, group=None):
        config = getattr(model, "module", model).config
        self.num_experts = num_experts(config)
        self.coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        # with tp or cp the ranks routing different tokens are more than the data ranks (parallel/ep.py)
        self.group, self.tp_group = getattr(getattr(model, "module", model), ROUTING_ATTR, (group, None))
        self.model, self.num_micro = model, num_micro_batches
        self.aux = torch.zeros((), dtype=torch.float64)
        self.counts: torch.Tensor | None = None

    def routing(self):
        return record_routing(self.model) if self.num_experts else _no_routing()

    def add_objective(self, loss: torch.Tensor, seen, dp_size: int) -> torch.Tensor:
        """`loss` (the micro-batch's scaled token loss) plus coef · its aux part / micro-batches,
        scaled by `dp_size` as the token loss is (FSDP averages the gradients over the ranks)."""
        if not seen:
            return loss
        part, counts = aux_loss_part(seen, self.num_experts, self.group)
        self.aux = self.aux.to(part.device) + part.detach().double() / self.num_micro
        self.counts = counts if self.counts is None else self.counts + counts
        return loss + part * (self.coef * dp_size / self.num_micro)

    def parts(self, dp_size: int) -> dict[str, torch.Tensor]:
        """{aux_loss, expert_load_cv} as this rank's parts of global means (summed over the
        dp_size ranks by the loop; the load CV is the same on every rank, so each holds 1/dp_size)."""
        if self.counts is None:
            return {}
        if self.tp_group is not None:  # the loop counts one rank of a tp group; each holds its tokens' part
            dist.all_reduce(self.aux, group=self.tp_group)
        return {"aux_loss": self.aux, "expert_load_cv": load_cv(self.counts) / dp_size}


@contextmanager
def _no_routing():
    yield None
