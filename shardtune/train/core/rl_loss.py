"""The group-relative advantage and the clipped policy loss of GRPO, DAPO and Dr. GRPO (docs/rl.md).

Shao et al. 2024 (DeepSeekMath, GRPO) eq. 3, with TRL's GRPOTrainer conventions for each `rl.loss`:
  ratio r = exp(log πθ − log π_old);  per-token loss ℓ = −min(r·A, clip(r, 1 − ε, 1 + ε_high)·A) + β·KL
  KL = exp(log π_ref − log πθ) − (log π_ref − log πθ) − 1   (Schulman's k3 estimator, GRPO eq. 4)
  A = (R − mean of its group) / (std of its group + 1e-4)     (std unbiased; no division under dr_grpo)
Normalisation over the step's GLOBAL batch (every micro-batch, every data-parallel rank):
  grpo:    Σ_i (Σ_t ℓ_it m_it / Σ_t m_it) / N_completions      (each completion's token mean, then the mean)
  dapo:    Σ_it ℓ_it m_it / N_tokens                            (Yu et al. 2025 eq. 8: token-level)
  dr_grpo: Σ_it ℓ_it m_it / (N_completions · max_new_tokens)    (Liu et al. 2025: a constant normaliser)
Each function here returns this rank's part (its sums over the global count), so the parts sum to the
global loss and its gradient is the global one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


def group_advantages(rewards: torch.Tensor, group: int, scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages (N,), each group's std (N / group,)) of `rewards` (N,) in consecutive groups."""
    g = rewards.view(-1, group)
    std = g.std(dim=1)  # unbiased, as torch.std (TRL)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (std.unsqueeze(1) + STD_EPS)
    return adv.reshape(-1), std


@dataclass
class TokenTerms:
    loss: torch.Tensor  # (B, T) per-token loss (before the mask)
    clipped: torch.Tensor  # (B, T) bool: the clip took effect (the ratio left [1 − ε, 1 + ε_high] the way A pushes)
    kl: torch.Tensor | None  # (B, T) k3 estimate, None without a reference


def token_terms(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                eps_high: float, beta: float = 0.0, ref_logps: torch.Tensor | None = None) -> TokenTerms:
    """The clipped surrogate per token; `advantages` (B,) broadcast over each row's tokens."""
    ratio = torch.exp(logps - old_logps)
    adv = advantages.unsqueeze(1).to(ratio.dtype)
    clipped_ratio = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = -torch.min(ratio * adv, clipped_ratio * adv)
    clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    kl = None
    if beta != 0.0 and ref_logps is not None:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + beta * kl
    return TokenTerms(loss=loss, clipped=clipped, kl=kl)


def reduce_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, *, num_completions: torch.Tensor,
                num_tokens: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """This rank's part of the step's loss: its sums over the global counts, as the module says."""
    m = mask.to(per_token.dtype)
    if loss_type == "grpo":
        per_seq = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)
        return per_seq.sum() / num_completions
    if loss_type == "dapo":
        return (per_token * m).sum() / num_tokens.clamp(min=1)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (num_completions * max_new_tokens)
    raise ValueError(f"unknown rl.loss {loss_type!r}")
