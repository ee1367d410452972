"""Expert parallelism (`apply_ep`): each rank of an ep group keeps E/ep of every MoE layer's experts,
and the tokens travel to their experts and back in two all-to-alls (GShard, Lepikhin et al. 2020
§2.2; torchtitan's `ExpertParallel`), dropless: every token reaches each of its top-k experts,
whatever the imbalance (no capacity factor), with uneven splits (`all_to_all_single`'s split
sizes; gloo and NCCL both take them).

Per MoE layer, on each rank (N tokens, top-k, E experts, n = E/ep local):
  1. sort the N·k (token, expert) pairs by expert: consecutive runs go to ranks 0..ep-1;
  2. exchange the per-expert counts (one all_to_all of ep·n integers): each rank learns how many
     rows it receives from each source, for each of its experts;
  3. dispatch: all_to_all_single of the sorted rows (uneven splits);
  4. the local experts as one grouped GEMM per projection (transformers' `grouped_mm` forward on n
     experts, every received row weighted 1);
  5. combine: the reverse all_to_all_single (its backward is the forward's, splits swapped);
  6. weight each row by its routing weight, undo the sort, sum each token's k rows.
A rank that receives no rows still joins steps 2, 3 and 5 (each collective is called by every rank
whatever its counts) and gives its experts a zero gradient, so FSDP's reduce-scatter of them
matches on every rank. The router, attention and everything else stay replicated over the ep group.
Model code stays free of distributed code: the experts' `forward` is replaced from outside.
"""
from __future__ import annotations

from types import MethodType

import torch
import torch.distributed as dist
from torch import nn

from shardtune.errors import UserError
from shardtune.parallel.record import record

EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
ROUTING_ATTR = "_shardtune_routing"  # on a MoE model under tp or cp: (routing group, tp group); moe.py reads it


def mark_routing(model: nn.Module, tp_group) -> None:
    """Under tp or cp every rank routes tokens of its own (its sequence shard, or its 1/tp of them), so
    the load-balancing loss's global counts sum over all of them, not the data ranks only: the world
    (pipelines refuse MoE models), and the tp group for the aux metric (train/core/moe.py MoeTerms)."""
    setattr(model, ROUTING_ATTR, (dist.group.WORLD, tp_group))


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """Each MoE layer's experts module (transformers' 3-D `gate_up_proj` / `down_proj` holders)."""
    return [m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
            and m.gate_up_proj.ndim == 3]


class _AllToAllV(torch.autograd.Function):
    """all_to_all_single over dim 0 with split sizes; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _local_experts(experts: nn.Module, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """The rows (R, h) through their local experts (R,): one grouped GEMM per projection."""
    from transformers.integrations.moe import grouped_mm_experts_forward  # noqa: PLC0415 transformers only here

    if rows.shape[0] == 0:  # no token for any local expert: a zero gradient for every expert tensor,
        # and the output still depends on `rows`, so backward reaches the dispatch's all-to-all
        anchor = sum(getattr(experts, n).sum() for n in EXPERT_TENSORS if getattr(experts, n, None) is not None)
        return rows * 0.0 + 0.0 * anchor
    ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
    return grouped_mm_experts_forward(experts, rows, local_ids.unsqueeze(1), ones)


def _ep_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (hidden (N, h), top-k indices and weights (N, k)) with the
    experts spread over the ep group (module docstring)."""
    ep, group, n = self.ep_degree, self.ep_group, self.num_experts
    num_tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)  # (N·k,) global expert ids
    order = torch.argsort(flat, stable=True)  # by expert: rank 0's experts first
    send = torch.bincount(flat, minlength=n * ep).view(ep, n)  # (dest rank, its local expert)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[src, e]: rows src sends to my expert e
    in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    rows = _AllToAllV.apply(hidden_states[order // k], out_splits, in_splits, group)  # (R, h) by src, expert
    local_ids = torch.repeat_interleave(torch.arange(n, device=flat.device).repeat(ep), recv.flatten())  # (R,)
    out = _AllToAllV.apply(_local_experts(self, rows, local_ids), in_splits, out_splits, group)  # (N·k, h)
    weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    unsorted = weighted[torch.argsort(order)]  # back to (token, slot) order
    return unsorted.view(num_tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def apply_ep(model: nn.Module, ep_group) -> None:
    """Keep this rank's E/ep experts of every MoE layer (rows [r·E/ep, (r+1)·E/ep) of each expert
    tensor; on the meta device or real) and route tokens through the ep group, in place. Call it
    before FSDP: the local experts then shard over the expert-FSDP ranks only (see docs/moe.md)."""
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    found = expert_modules(model)
    if not found:
        raise UserError("parallel.ep needs a mixture-of-experts model; this model has no experts")
    for experts in found:
        total = int(experts.num_experts)
        if total % ep:
            raise UserError(f"parallel.ep {ep} does not divide the {total} experts per layer; "
                            f"use an ep that divides {total}")
        n = total // ep
        for name in EXPERT_TENSORS:
            full = getattr(experts, name, None)
            if full is not None:
                setattr(experts, name, nn.Parameter(full.detach()[rank * n:(rank + 1) * n].clone(),
                                                    requires_grad=full.requires_grad))
        experts.num_experts, experts.ep_degree, experts.ep_group, experts.ep_offset = n, ep, ep_group, rank * n
        experts.forward = MethodType(_ep_forward, experts)
    record(model).ep = ep


def ep_rows(model: nn.Module, param_name: str) -> tuple[int, int] | None:
    """(first expert row this rank holds, the full tensor's dim-0 size) of `param_name` under
    `apply_ep`, None for any other tensor: a weight loader reads rows [first, first + local rows)."""
    owner, _, leaf = param_name.rpartition(".")
    module = model.get_submodule(owner) if leaf in EXPERT_TENSORS else None
    if module is None or not hasattr(module, "ep_offset"):
        return None
    return int(module.ep_offset), int(module.num_experts * module.ep_degree)


def whole_model_params(model: nn.Module) -> int:
    """The model's parameter count as without expert parallelism: this rank's E/ep experts of each
    `apply_ep` layer count ep times (every rank holds as many); the rest as they are."""
    extra = sum(getattr(m, name).numel() * (m.ep_degree - 1) for m in expert_modules(model)
                if hasattr(m, "ep_degree") for name in EXPERT_TENSORS if getattr(m, name, None) is not None)
    return sum(p.numel() for p in model.parameters()) + extra


def ep_clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor | None:
    """clip_grad_norm_ for a model under `apply_ep` (None for any other model: the caller clips as
    before). The experts' gradients are FSDP DTensors on the expert-FSDP mesh and hold only this
    rank's experts, the others' on the data-parallel mesh: one norm per mesh (torch's DTensor norm
    refuses to mix meshes), the experts' squared norm summed over the ep group, then one clip
    coefficient for all (torchtitan's EP-aware clip does the same)."""
    found = [m for m in expert_modules(model) if hasattr(m, "ep_group")]
    if not found:
        return None
    expert_ids = {id(p) for m in found for p in m.parameters()}
    params = [p for p in model.parameters() if p.grad is not None]

    def norm(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=params[0].grad.device)
        total = torch.nn.utils.get_total_norm(grads)
        return total.full_tensor() if hasattr(total, "full_tensor") else total

    experts_sq = norm([p.grad for p in params if id(p) in expert_ids]) ** 2
    dist.all_reduce(experts_sq, group=found[0].ep_group)  # each ep rank holds other experts
    total = (norm([p.grad for p in params if id(p) not in expert_ids]) ** 2 + experts_sq).sqrt()
    # torch's clip_grads_with_norm_ rule (max_norm / (norm + 1e-6), at most 1) as one host scalar: its
    # foreach multiply also refuses DTensors of two meshes
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return total


def _rows_mesh(fsdp_mesh):
    """The mesh that says where this rank's expert rows lie in the whole [E, ...] tensor: build_mesh's
    (dp_replicate, efsdp, ep) ranks reordered to (dp_replicate, ep, efsdp) (hsdp) or this replica's
    (ep, efsdp): Shard(0) on ep, then Shard(0) on efsdp, is apply_ep's row split followed by FSDP's
    (both torch.chunk's). Only rank coordinates are read (DCP's offsets): no process group is made."""
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 only checkpoints need it

    root = fsdp_mesh._get_root_mesh()
    if (cached := getattr(root, "_shardtune_rows_mesh", {}).get(fsdp_mesh.ndim)) is not None:
        return cached
    if root.mesh_dim_names != ("dp_replicate", "efsdp", "ep"):
        raise RuntimeError(f"expert tensors sharded on {root.mesh_dim_names}, not build_mesh's expert mesh")
    ranks = root.mesh.permute(0, 2, 1)
    if fsdp_mesh.ndim == 1:  # zero2/zero3: this replica's plane
        ranks = ranks[root.get_coordinate()[0]]
    names = ("dp_replicate", "ep", "efsdp")[-ranks.ndim:]
    mesh = DeviceMesh(root.device_type, ranks, mesh_dim_names=names, _init_backend=False)
    root._shardtune_rows_mesh = getattr(root, "_shardtune_rows_mesh", {}) | {fsdp_mesh.ndim: mesh}
    return mesh


def _whole(t: torch.Tensor, experts: nn.Module) -> torch.Tensor:
    """One rank's FSDP-sharded rows of a split expert tensor (a DTensor on the expert-FSDP mesh) as a
    DTensor of the whole [E, ...] tensor sharing its storage (DCP then writes and reads the rows at
    their place, whatever ep and dp the other side runs)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: PLC0415

    if not isinstance(t, DTensor) or t.ndim < 1:
        return t
    mesh = _rows_mesh(t.device_mesh)
    shape = (t.shape[0] * experts.ep_degree, *t.shape[1:])
    stride = tuple(int(s) for s in torch.empty(shape, device="meta").stride())
    placements = (*(Replicate(),) * (mesh.ndim - 2), Shard(0), Shard(0))
    return DTensor.from_local(t.to_local(), mesh, placements, run_check=False, shape=shape, stride=stride)


def ep_whole_state(model: nn.Module, sd: dict) -> dict:
    """{"model": ..., "optim": ...} (torch's FQN state dicts) with every split expert tensor, and its
    optimizer states, as the whole [E, ...] tensor's DTensor (`_whole`); `sd` unchanged without ep.
    Loading into the result fills the original tensors (shared storage)."""
    drop = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
    clean = lambda n: ".".join(s for s in n.split(".") if s not in drop)  # noqa: E731
    owners = {f"{clean(name)}.{leaf}": m for name, m in model.named_modules() if hasattr(m, "ep_group")
              for leaf in EXPERT_TENSORS if getattr(m, leaf, None) is not None}
    if not owners:
        return sd
    model_sd = {k: _whole(v, owners[k]) if k in owners else v for k, v in sd["model"].items()}
    optim = dict(sd["optim"])
    optim["state"] = {k: ({n: _whole(v, owners[k]) if isinstance(v, torch.Tensor) and v.ndim > 0 else v
                           for n, v in st.items()} if k in owners else st) for k, st in optim["state"].items()}
    return {"model": model_sd, "optim": optim}
