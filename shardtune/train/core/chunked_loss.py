"""Chunked cross-entropy: the LM head's projection and the loss over K token chunks, so the full
[T, V] fp32 logits (and their gradient) never exist at once (`train.loss_chunks`, docs/loss.md).

Forward: per chunk of rows, logits = h·Wᵀ in the compute dtype, upcast to fp32, log-sum-exp and
the target's logit; only the per-row log-sum-exp (4 B a token) is kept. Backward recomputes each
chunk's logits (one more head matmul: Liger's fused linear cross-entropy does the gradient in
forward instead, which keeps a V×h weight gradient alive across the forward peak) and forms
softmax − onehot one chunk at a time, accumulating dW in the compute dtype (as Liger does).
Under FSDP2 the root reshards the head (and tied embedding) after its forward, so the loss runs
in a forward hook on the root that fires before FSDP's own post-forward hook: the all-gathered
weight is live, and its gradient lands in the unsharded parameter FSDP reduce-scatters.
One function gives each row's log-prob (`chunked_token_logps`): the cross-entropy is minus their
sum, DPO's sequence log-probs (dpo.py) their sums per side.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardtune.parallel.cp import shard_batch
from shardtune.parallel.tp import tp_degree
from shardtune.rules.loss import resolve_loss_chunks
from shardtune.strategies import IGNORE_INDEX  # the one definition (HF / torch cross_entropy convention)


class _ChunkedLinearLogProbs(torch.autograd.Function):
    """Per row: log softmax(hidden @ weightᵀ)[target] (0 for IGNORE_INDEX rows), in row chunks."""

    @staticmethod
    def forward(ctx, hidden, weight, target, num_chunks: int):  # hidden (N, h) in the compute dtype
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(hidden.dtype)
            lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # (N,)
            logp = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # (N,)
            for h_c, t_c, lse_c, out_c in zip(hidden.tensor_split(num_chunks), target.tensor_split(num_chunks),
                                              lse.tensor_split(num_chunks), logp.tensor_split(num_chunks)):
                logits = (h_c @ w.t()).float()  # (n, V)
                lse_c.copy_(torch.logsumexp(logits, dim=-1))
                valid = t_c != IGNORE_INDEX
                picked = logits.gather(1, torch.where(valid, t_c, 0).unsqueeze(1)).squeeze(1)
                out_c.copy_(torch.where(valid, picked - lse_c, 0.0))
                del logits
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.num_chunks = num_chunks
        return logp

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (N,): d logp_i / d logits_i = onehot − softmax
        hidden, weight, target, lse = ctx.saved_tensors
        k, need_h, need_w = ctx.num_chunks, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=hidden.dtype) if need_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(hidden.dtype)
            rows = zip(hidden.tensor_split(k), target.tensor_split(k), lse.tensor_split(k),
                       grad_out.float().tensor_split(k), grad_h.tensor_split(k) if need_h else [None] * k)
            for h_c, t_c, lse_c, g_c, gh_c in rows:
                valid = t_c != IGNORE_INDEX
                d = (h_c @ w.t()).float().sub_(lse_c.unsqueeze(1)).exp_().neg_()  # −softmax (n, V)
                d.scatter_add_(1, torch.where(valid, t_c, 0).unsqueeze(1), torch.ones_like(d[:, :1]))
                d.mul_(torch.where(valid, g_c, 0.0).unsqueeze(1))
                d_logits = d.to(hidden.dtype)
                del d
                if need_h:
                    gh_c.copy_(d_logits @ w)
                if need_w:
                    grad_w.addmm_(d_logits.t(), h_c)
            del w  # before the cast: an fp32 head (autocast) holds one V×h copy at a time
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None


def chunked_token_logps(hidden, weight, target, num_chunks: int) -> torch.Tensor:
    """(N,) fp32 log-probs of `target` under `hidden` (N, h) projected by `weight` (V, h)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        hidden = hidden.to(torch.get_autocast_dtype(device))
    return _ChunkedLinearLogProbs.apply(hidden, weight, target, max(1, min(int(num_chunks), hidden.shape[0])))


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                          num_chunks: int) -> torch.Tensor:
    """Sum of token losses of `hidden` (N, h) projected by `weight` (V, h) against `target` (N,)
    (IGNORE_INDEX rows count nothing): minus the summed token log-probs, the projection in
    hidden's dtype (or autocast's)."""
    return -chunked_token_logps(hidden, weight, target, num_chunks).sum()


def _head(lm: nn.Module) -> nn.Linear:
    head = lm.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        raise ValueError(f"train.loss_chunks > 1 needs a bias-free nn.Linear LM head, got {type(head).__name__}; "
                         "set train.loss_chunks=1")
    return head


@contextmanager
def _loss_in_root_forward(lm: nn.Module, target: torch.Tensor, num_chunks: int, loss_fn=None):
    """Hooks that put the chunked loss into `lm`'s output as `.loss`, inside its forward
    (`loss_fn(hidden, weight, target, num_chunks)`, default `chunked_cross_entropy`)."""
    loss_fn = loss_fn or chunked_cross_entropy
    head, seen = _head(lm), {}

    def keep_hidden(_module, _args, out):
        seen["hidden"] = out.last_hidden_state  # (B, S, h): what lm_head would get

    def add_loss(_module, _args, out):
        hidden = seen.pop("hidden")
        out["loss"] = loss_fn(hidden.flatten(0, 1), head.weight, target.flatten(), num_chunks)
        return out

    handles = [lm.get_decoder().register_forward_hook(keep_hidden),
               lm.register_forward_hook(add_loss, prepend=True)]  # before FSDP's post-forward reshard
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def lm_token_loss_sum(model: nn.Module, batch: dict, loss_chunks: int | None,
                      autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum of token losses of one batch (input_ids, position_ids, labels already shifted) through
    `model` (DDP, FSDP2 or a plain HF causal LM), fp32 0-dim. One chunk: the full logits and
    F.cross_entropy as before, bit for bit; K > 1: the chunked loss inside the root's forward,
    the head applied to no position there. The model runs under autocast to `autocast_dtype`."""
    lm = getattr(model, "module", model)  # DDP wraps; FSDP2 does not
    # tensor parallel: vocabulary-sharded logits and loss_parallel (the caller's loss_context), one chunk
    k = resolve_loss_chunks(loss_chunks, lm.config.vocab_size, tp_degree(lm))
    batch = shard_batch(lm, batch)  # context parallel: this rank's rows (labels shifted before the split)
    pos, labels = batch["position_ids"], batch["labels"]
    # a pipeline's later stage (parallel/pp.py) feeds the previous stage's hidden states, not ids
    inputs = {k: batch[k] for k in ("input_ids", "inputs_embeds") if k in batch}
    amp = torch.autocast(labels.device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    if k == 1:
        with amp:
            logits = model(**inputs, position_ids=pos).logits
        # the logits die with this frame: nothing in backward needs them (the loss saved its own
        # fp32 log-softmax), e·T·V bytes freed before backward (docs/calibration.md)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                           ignore_index=IGNORE_INDEX, reduction="sum")
        return loss.full_tensor() if isinstance(loss, DTensor) else loss  # TP: replicated, no comm
    no_position = torch.empty(0, dtype=torch.long, device=labels.device)
    with amp, _loss_in_root_forward(lm, labels, k):
        out = model(**inputs, position_ids=pos, logits_to_keep=no_position)
    return out.loss
