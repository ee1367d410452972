"""Direct Preference Optimisation on the sharded step (`train.objective: dpo`, docs/dpo.md).

Rafailov et al. 2023 eq. 7, with conservative label smoothing ε (TRL's "sigmoid" loss):
  z = β·[(log πθ(y_c|x) − log π_ref(y_c|x)) − (log πθ(y_r|x) − log π_ref(y_r|x))]
  loss = −(1 − ε)·log σ(z) − ε·log σ(−z);  rewards r_c, r_r = β·(log πθ − log π_ref) of each side.
The log-probs are sums over each side's response tokens, computed in vocabulary chunks inside the
root's forward (chunked_loss.py's hook), so [T, V] logits never exist (under tp: the vocabulary-
sharded logits' per-token cross-entropy in `loss_parallel`); chosen and rejected share a
row (train/data/preference.py), so one forward scores both. A side is sequence k of its row, found
from the position restarts: slot (row, k // 2, k % 2) of a (B, P, 2) tensor, P = ⌈T / 2⌉.

Normalisation as the SFT step's: each pair's loss / the number of pairs over all micro-batches
and data-parallel ranks (one all-reduce of [pairs, target tokens] per step), so the gradient is the
global mean over pairs. MoE models: the policy forward's load-balancing loss is added as in the SFT
step (train/core/moe.py MoeTerms: router_aux_loss_coef × the mean over micro-batches of the global
aux; `aux_loss` and `expert_load_cv` logged); the reference forward adds nothing. The metrics
(reward_acc, reward_margin, chosen/rejected rewards) are this rank's parts of global means, summed
over ranks by the loop's one logged-step gather.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardtune.parallel.cp import CPState, cp_degree, cp_state, shard_batch
from shardtune.parallel.tp import is_tp, loss_context
from shardtune.rules.loss import resolve_loss_chunks
from shardtune.train.core.chunked_loss import IGNORE_INDEX, _loss_in_root_forward, chunked_token_logps
from shardtune.train.core.moe import MoeTerms
from shardtune.train.core.step import StepOptions, StepResult, accumulation, clip_and_step

METRICS = ("reward_acc", "reward_margin", "reward_chosen", "reward_rejected")


def _slots(batch: dict) -> tuple[torch.Tensor, int]:
    """(B, T) sequence index of every position (restarts of position_ids), and 2·P."""
    seg = (batch["position_ids"] == 0).long().cumsum(1) - 1
    t = seg.shape[1]
    return seg.clamp(min=0), t + t % 2


def _per_side(values: torch.Tensor, batch: dict, cp: CPState | None = None) -> torch.Tensor:
    """(B, T) per-position values of `batch`'s rows summed per side: (B, P, 2). With `cp`, `values`
    are this cp rank's block of each row (the rows padded as `shard_batch` pads them: the pad joins
    the last sequence), and the sums are added over the cp group."""
    seg, width = _slots(batch)
    if cp is not None:
        n = values.shape[1]
        seg = torch.cat([seg, seg[:, -1:].expand(-1, n * cp.size - seg.shape[1])], dim=1)
        seg = seg[:, cp.rank * n:(cp.rank + 1) * n]
    out = torch.zeros(values.shape[0], width, dtype=values.dtype, device=values.device).scatter_add(1, seg, values)
    if cp is not None:
        out = _SumOverGroup.apply(out, cp.group)
    return out.view(values.shape[0], width // 2, 2)


def valid_pairs(batch: dict) -> torch.Tensor:
    """(B, P) bool: the slots holding a pair with response tokens on both sides."""
    return (_per_side((batch["labels"] != IGNORE_INDEX).float(), batch) > 0).all(-1)


def sequence_logps(model: nn.Module, batch: dict, loss_chunks: int | None,
                   autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(B, P, 2) fp32: each side's summed response-token log-probs through `model` (FSDP2, DDP or a
    plain HF causal LM), the LM head applied in chunks inside the root's forward. Tensor parallel:
    the vocabulary-sharded logits' per-token cross-entropy under `loss_parallel` (as the SFT step's
    loss), so the backward of the result must run in `loss_context(model)` too."""
    lm = getattr(model, "module", model)
    local = shard_batch(lm, batch)  # context parallel: this rank's block of every row
    ids, pos, labels = local["input_ids"], local["position_ids"], local["labels"]
    amp = torch.autocast(ids.device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    if is_tp(lm):
        with amp, loss_context(lm):
            logits = model(input_ids=ids, position_ids=pos).logits  # (B, T, V/tp) per rank
            nll = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                  reduction="none")  # 0 at IGNORE_INDEX
            token = -(nll.full_tensor() if isinstance(nll, DTensor) else nll)
    else:
        k = resolve_loss_chunks(loss_chunks, lm.config.vocab_size)
        no_position = torch.empty(0, dtype=torch.long, device=ids.device)
        with amp, _loss_in_root_forward(lm, labels, k, chunked_token_logps):
            token = model(input_ids=ids, position_ids=pos, logits_to_keep=no_position).loss
    return _per_side(token.view(ids.shape), batch, cp_state(lm))


class _SumOverGroup(torch.autograd.Function):
    """The sum of every cp rank's partial side sums. Every rank then computes the same pair loss from
    it, so each rank's gradient of its own part is the loss's gradient of the sum: backward is the
    identity (an all-reduce there would count it cp times)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def dpo_losses(policy: torch.Tensor, reference: torch.Tensor, beta: float, label_smoothing: float = 0.0):
    """(losses, chosen rewards, rejected rewards), each (...,) from (..., 2) summed log-probs."""
    rewards = beta * (policy - reference.to(policy.dtype))
    z = rewards[..., 0] - rewards[..., 1]
    losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return losses, rewards[..., 0].detach(), rewards[..., 1].detach()


def simpo_losses(policy: torch.Tensor, lengths: torch.Tensor, beta: float, gamma: float,
                 label_smoothing: float = 0.0):
    """SimPO (Meng et al. 2024 eq. 6): no reference; the rewards are β × each side's mean token
    log-prob, and the loss asks their margin to exceed γ: −log σ(r_c − r_r − γ)."""
    rewards = beta * policy / lengths.clamp(min=1).to(policy.dtype)
    z = rewards[..., 0] - rewards[..., 1] - gamma
    losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return losses, rewards[..., 0].detach(), rewards[..., 1].detach()


def side_lengths(batch: dict) -> torch.Tensor:
    """(B, P, 2): the response tokens of each side."""
    return _per_side((batch["labels"] != IGNORE_INDEX).float(), batch)


def pair_sums(losses, chosen, rejected, valid) -> torch.Tensor:
    """[loss, reward_acc, reward_margin, reward_chosen, reward_rejected] summed over the valid pairs."""
    v = valid.to(losses.dtype)
    return torch.stack([(losses * v).sum(), ((chosen > rejected).to(v.dtype) * v).sum(),
                        ((chosen - rejected) * v).sum(), (chosen * v).sum(), (rejected * v).sum()])


class DPO:
    """The objective's step and evaluation; `reference.logps(batch, opts)` gives reference log-probs
    where a batch carries none (train/core/dpo_ref.py). β and ε come from StepOptions."""

    step_tokens_fixed = True  # a step's rows × seq_len tokens (a pair's two sides share one row)

    def __init__(self, reference):
        self.reference = reference

    @property
    def flops_factor(self) -> float:
        """The model FLOPs a trained token costs, in units of the policy's: a live reference (a frozen
        copy, or LoRA's base) adds a forward, 4/3 (forward + backward is 3 forwards); precomputed
        reference log-probs and simpo's none add nothing."""
        return 4 / 3 if self.reference is not None else 1

    def blocks_memory_tracker(self) -> bool:
        """A frozen copy outside FSDP (ddp/zero1): torch's MemTracker hooks the gradient of every
        parameter a forward uses and refuses the copy's (FSDPMemTracker hooks the policy's FSDP
        states only); such runs are not tracked (train/rank/loop.py), as LoRA runs are not."""
        model = getattr(self.reference, "model", None)
        return model is not None and not isinstance(model, FSDPModule)

    def tracked_bytes(self, tracked: dict) -> dict:  # + the frozen reference copy, as plan's memory.reference
        return add_reference_bytes(tracked, self.reference)

    def ref_logps(self, batch: dict, opts: StepOptions) -> torch.Tensor:
        return batch["ref_logps"] if "ref_logps" in batch else self.reference.logps(batch, opts)

    def losses(self, policy: torch.Tensor, batch: dict, opts: StepOptions):
        """(losses, chosen rewards, rejected rewards) of the objective (dpo or simpo)."""
        if opts.objective == "simpo":
            return simpo_losses(policy, side_lengths(batch), opts.dpo_beta, opts.simpo_gamma, opts.dpo_label_smoothing)
        return dpo_losses(policy, self.ref_logps(batch, opts), opts.dpo_beta, opts.dpo_label_smoothing)

    def step(self, model, optimizer, scheduler, micro_batches: list[dict], opts: StepOptions, *, dp_group=None,
             dp_size: int, activations=None) -> StepResult:
        """dpo's train_step: forward/backward over the micro-batches, clip, optimizer step."""
        optimizer.zero_grad(set_to_none=True)
        valid = [valid_pairs(mb) for mb in micro_batches]
        counts = torch.stack([torch.stack([v.sum() for v in valid]).sum(),
                              torch.stack([(mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches]).sum()])
        dist.all_reduce(counts, group=dp_group)  # ONE all-reduce: [pairs, target tokens]
        denom = counts[0].clamp(min=1).to(torch.float32)
        sums = torch.zeros(5, device=counts.device)
        moe = MoeTerms(model, len(micro_batches), dp_group)  # MoE: the policy's load-balancing loss
        for i, mb in enumerate(micro_batches):
            if opts.objective == "dpo":
                mb["ref_logps"] = self.ref_logps(mb, opts)  # no grad, outside the policy's backward
            with accumulation(model, last=i == len(micro_batches) - 1):
                with activations.micro_batch() if activations else nullcontext(), moe.routing() as seen:
                    pol = sequence_logps(model, mb, opts.loss_chunks, opts.autocast_dtype)
                losses, chosen, rejected = self.losses(pol, mb, opts)
                part = pair_sums(losses, chosen, rejected, valid[i])
                with loss_context(model):  # TP: loss_parallel's backward
                    moe.add_objective(part[0] * dp_size / denom, seen, dp_size).backward()
            sums += part.detach()
        norm, lr, skipped = clip_and_step(model, optimizer, scheduler, sums[0], opts)
        parts = sums / denom / cp_degree(model)  # cp: every rank of the group holds the same pair sums
        return StepResult(loss_part=parts[0], grad_norm=norm.detach(), lr=lr, num_tokens=counts[1], skipped=skipped,
                          parts=dict(zip(METRICS, parts[1:])) | moe.parts(dp_size))

    @torch.no_grad()
    def evaluate(self, model, batches: list[dict], device, opts: StepOptions, group=None) -> dict:
        """Held-out pairs (each batch carrying ref_logps): val_loss and val_<metric>, global means
        over every rank's pairs (collective; every rank runs the same number of forwards)."""
        n = torch.tensor([len(batches)], device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
        sums = torch.zeros(7, dtype=torch.float64, device=device)
        was_training = model.training
        model.eval()
        try:
            for i in range(int(n)):
                batch = {k: v.to(device) for k, v in batches[min(i, len(batches) - 1)].items()}
                pol = sequence_logps(model, batch, opts.loss_chunks, opts.autocast_dtype)
                losses, chosen, rejected = self.losses(pol, batch, opts)
                valid = valid_pairs(batch) & (i < len(batches))
                score = pol / side_lengths(batch).clamp(min=1) if opts.objective == "simpo" else pol
                prefers = ((score[..., 0] > score[..., 1]) & valid).sum()  # the policy's own preference
                sums += torch.cat([pair_sums(losses, chosen, rejected, valid), torch.stack([prefers, valid.sum()])
                                   ]).double()
        finally:
            model.train(was_training)
        dist.all_reduce(sums, group=group)
        means = (sums[:6] / sums[6]).tolist() if float(sums[6]) > 0 else [float("nan")] * 6
        return dict(zip(("val_loss", *(f"val_{m}" for m in METRICS), "val_pref_acc"), means))


def held_bytes(model) -> int:
    """Bytes this rank holds of `model`'s parameters: each local shard's storage (FSDP2 pads it), as
    torch's memory trackers count them."""
    locals_ = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    return sum(t.untyped_storage().nbytes() for t in locals_)


def add_reference_bytes(tracked: dict, reference) -> dict:
    """A tracked step's bytes (train/core/memtrack.py) plus the frozen reference copy this rank holds
    (`reference`, also in `total`): made before the tracked step, the trackers never see it. 0 for
    LoRA's adapters-off base, precompute and simpo (no copy). The trainer's memory.json and the
    simulator (verify/simulate.py) both add it here."""
    model = getattr(reference, "model", None)
    ref = held_bytes(model) if model is not None else 0
    return {**tracked, "reference": ref, "total": tracked["total"] + ref}


def reference_preference(batches: list[dict], device, group=None) -> tuple[int, int]:
    """(held-out pairs whose chosen side the reference, i.e. the initial policy, scores higher,
    held-out pairs) over every rank (collective)."""
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for b in batches:
        valid = valid_pairs(b)
        counts += torch.stack([((b["ref_logps"][..., 0] > b["ref_logps"][..., 1]) & valid).sum(), valid.sum()]
                              ).double().to(device)
    dist.all_reduce(counts, group=group)
    return int(counts[0]), int(counts[1])
