"""Context parallelism by all-to-all (DeepSpeed Ulysses) on a Hugging Face Llama-style causal LM:
each rank of a cp group holds s / cp consecutive tokens of every row through the decoder; inside
attention an all-to-all over the cp group turns q, k, v from sequence-sharded into head-sharded
(the full sequence, H / cp heads: with tp, H / tp / cp), attention runs per document on the full
sequence, and an all-to-all brings the output back. Why this and not ring attention, and what
composes: docs/long-context.md.

Hooked in through transformers' attention registry (`AttentionInterface`, the model config's
`_attn_implementation`), not by patching modules. Without a mask function registered for that
name, HF builds no mask (it would be the local slice's); the document structure comes from the
FULL sequence's position ids, which `shard_batch` records on the model's `CPState` before the
forward (a document starts where the position id does not follow its predecessor, HF's
`find_packed_sequence_indices` rule), and each document runs causal SDPA on its own rows.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface

from shardtune.parallel.layers import decoder_layers
from shardtune.parallel.record import record
from shardtune.rules.cp import check_cp, kv_repeat
from shardtune.strategies import IGNORE_INDEX

ATTN_NAME = "shardtune_cp"  # the attention implementation name registered with transformers
CP_ATTR = "_shardtune_cp"  # on the model and on each attention module: its CPState


class CPState:
    """What every attention module of one cp model shares: the cp group, this rank's index in it,
    the tp degree (sequence parallelism splits the local rows further), and the documents of the
    batch now running (`set_positions`)."""

    def __init__(self, group, rank: int, size: int, tp: int, sequence_parallel: bool):
        self.group, self.rank, self.size = group, rank, size
        self.split = size * (tp if sequence_parallel and tp > 1 else 1)  # what seq_len must divide by
        self.segments: list[list[tuple[int, int]]] = []  # per row: [(start, end)) of each document
        self.starts = torch.zeros(0, 0, dtype=torch.bool)  # (b, s) on the CPU: True where a document starts
        self.base_attn = "sdpa"  # the model's own attention implementation (apply_cp records it)

    def set_positions(self, position_ids: torch.Tensor) -> None:
        """Record the documents of a full (b, s) batch: one host sync per micro-batch."""
        first = position_ids[:, :1] - 1
        starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
        starts[:, 0] = True
        self.starts = starts.cpu()
        self.segments = _segments(self.starts)


def _segments(starts: torch.Tensor) -> list[list[tuple[int, int]]]:
    """(b, s) document starts → per row the [(start, end)) of each document."""
    out = []
    for row in starts:
        idx = row.nonzero().flatten().tolist() + [starts.shape[1]]
        out.append(list(zip(idx[:-1], idx[1:])))
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (cp equal chunks); its own adjoint, so backward is the same."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()  # (empty_like of a permuted view keeps its strides: the chunks would not be dim 0's)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(b, H, s/cp, d) of this rank's rows → (b, H/cp, s, d): its share of the heads, every row."""
    b, h, sl, d = x.shape
    x = x.reshape(b, cp, h // cp, sl, d).permute(1, 0, 2, 3, 4)  # chunk j: the heads rank j gets
    y = _AllToAll.apply(x, group)  # chunk i: rank i's rows of my heads
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * sl, d)


def heads_to_seq(y: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(b, H/cp, s, d) → (b, H, s/cp, d): the inverse of `seq_to_heads`."""
    b, h, s, d = y.shape
    y = y.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # chunk j: rank j's rows
    z = _AllToAll.apply(y, group)  # chunk i: rank i's heads of my rows
    return z.permute(1, 0, 2, 3, 4).reshape(b, cp * h, s // cp, d)


def _attend(q, k, v, segments, dropout: float, scaling: float | None) -> torch.Tensor:
    """Causal SDPA per document of each row (no [s, s] mask: flash kernels apply on a GPU)."""
    rows = []
    for i, segs in enumerate(segments):
        parts = [F.scaled_dot_product_attention(q[i:i + 1, :, a:e], k[i:i + 1, :, a:e], v[i:i + 1, :, a:e],
                                                dropout_p=dropout, is_causal=True, scale=scaling)
                 for a, e in segs]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


_UNRECORDED = ("context parallelism: the batch's documents were not recorded (parallel/cp.py shard_batch "
               "must slice the batch before the forward)")


# Under torch.compile the per-document loop runs as one opaque op: its Python ints (the documents)
# come from a (b, s) tensor inside the op, so the compiled layer guards on that tensor's shape only,
# not on the documents of each batch (which recompiled every step). Its backward recomputes the
# attention of the op's inputs and differentiates it eagerly (no dropout: see the caller).
@torch.library.custom_op("shardtune::cp_attend", mutates_args=())
def _cp_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
               scale: float | None) -> torch.Tensor:
    return _attend(q, k, v, _segments(starts), 0.0, scale).contiguous()


@_cp_attend.register_fake
def _(q, k, v, starts, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("shardtune::cp_attend_backward", mutates_args=())
def _cp_attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                        scale: float | None, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # an op's kernel runs with autograd's dispatch keys excluded: bring them back for the recompute
    keys = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.AutogradCUDA):
        keys = keys.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keys), torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = _attend(*leaves, _segments(starts), 0.0, scale)
        return tuple(g.contiguous() for g in torch.autograd.grad(out, leaves, grad))


@_cp_attend_backward.register_fake
def _(q, k, v, starts, scale, grad):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _cp_attend_setup(ctx, inputs, output):
    q, k, v, starts, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, starts)


def _cp_attend_grad(ctx, grad):
    q, k, v, starts = ctx.saved_tensors
    return *torch.ops.shardtune.cp_attend_backward(q, k, v, starts, ctx.scale, grad), None, None


_cp_attend.register_autograd(_cp_attend_grad, setup_context=_cp_attend_setup)


def cp_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The registered attention function: (b, H, s/cp, d) q and (b, KV, s/cp, d) k, v of this rank's
    rows → (b, s/cp, H, d) output, HF's contract (`sdpa_attention_forward`)."""
    state: CPState = getattr(module, CP_ATTR)
    cp, group = state.size, state.group
    q_heads, kv_heads = query.shape[1], key.shape[1]
    r = kv_repeat(kv_heads, q_heads, cp)
    if r > 1:  # cp does not divide the KV heads: repeat each as few times as makes it
        key, value = key.repeat_interleave(r, dim=1), value.repeat_interleave(r, dim=1)
    q, k, v = (seq_to_heads(t, group, cp) for t in (query, key, value))
    group_size = q.shape[1] // k.shape[1]
    if group_size > 1:  # GQA: query head j reads KV head j // group_size (HF's repeat_kv)
        k, v = k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1)
    dropout = dropout if module.training else 0.0
    if torch.compiler.is_compiling():  # the documents as a tensor: dynamo guards on a list's values
        if tuple(state.starts.shape) != (q.shape[0], q.shape[2]):
            raise RuntimeError(_UNRECORDED)
        if dropout:  # refused before any process starts (rules/cp.py check_cp): a hand-built model
            raise RuntimeError("context parallelism under train.compile: attention dropout (the backward "
                               "recomputes the attention, with another dropout mask)")
        out = torch.ops.shardtune.cp_attend(q, k, v, state.starts, scaling)
    else:
        if len(state.segments) != q.shape[0] or state.segments[0][-1][1] != q.shape[2]:
            raise RuntimeError(_UNRECORDED)
        out = _attend(q, k, v, state.segments, dropout, scaling)
    return heads_to_seq(out, group, cp).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, cp_attention_forward)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, tp: int = 1, sequence_parallel: bool = True) -> None:
    """Context-parallel `model` in place over the 1-D `cp_mesh` (call on the meta model, after TP)."""
    check_cp(cp_mesh.size(), tp=tp, hf=model.config.to_dict())  # a by-hand torchrun gets preflight's line
    state = CPState(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size(), tp, sequence_parallel)
    for layer in decoder_layers(model):
        setattr(layer.self_attn, CP_ATTR, state)
    state.base_attn = model.config._attn_implementation  # what `unsplit_attention` puts back
    model.config._attn_implementation = ATTN_NAME
    setattr(model, CP_ATTR, state)
    record(model).cp = state.size


@contextmanager
def unsplit_attention(model: nn.Module):
    """The attention `apply_cp` replaced, for forwards of the whole sequence on every rank of the cp
    group (generation: one short sequence, the same on each rank, their FSDP gathers in lockstep);
    cp's all-to-all again after. A model without cp: nothing changes."""
    state = cp_state(model)
    if state is None:
        yield
        return
    config = getattr(model, "module", model).config
    config._attn_implementation = state.base_attn
    try:
        yield
    finally:
        config._attn_implementation = ATTN_NAME


def cp_state(model: nn.Module) -> CPState | None:
    """The model's CPState (through a DDP wrapper), or None without context parallelism."""
    return getattr(getattr(model, "module", model), CP_ATTR, None)


def cp_degree(model: nn.Module) -> int:
    """The model's context-parallel degree (1 for a model `apply_cp` did not touch)."""
    state = cp_state(model)
    return state.size if state is not None else 1


def shard_batch(model: nn.Module, batch: dict) -> dict:
    """This cp rank's share of a full batch (input_ids, position_ids, labels already shifted): the
    documents recorded from the full position ids, then rows [c·s/cp, (c+1)·s/cp) of each tensor. A
    length that does not divide (validation, the evaluation's dummy) is padded at the end: the pad
    continues the last document's positions (causal: nothing earlier sees it) and has no label."""
    state = cp_state(model)
    if state is None:
        return batch
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    pad = -ids.shape[1] % state.split
    if pad:
        more = pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], pad)], dim=1)
        pos = torch.cat([pos.expand(ids.shape[0], -1), more.expand(ids.shape[0], -1)], dim=1)
        labels = torch.cat([labels, labels.new_full((labels.shape[0], pad), IGNORE_INDEX)], dim=1)
    state.set_positions(pos.expand(ids.shape[0], -1))
    n = ids.shape[1] // state.size
    cut = slice(state.rank * n, (state.rank + 1) * n)
    return {**batch, "input_ids": ids[:, cut], "position_ids": pos[:, cut], "labels": labels[:, cut]}
