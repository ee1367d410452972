"""Sampling a prompt's group of completions on the training policy itself (`train.objective: grpo`,
docs/rl.md): no second copy of the model.

FSDP2: `gathered(model)` all-gathers every layer once (each FSDPModule's `unshard`) and keeps them
gathered through the decode (`set_reshard_after_forward(False)`), then reshards: the weights are
gathered once a generation batch, not once a token, and the ranks need not run in lockstep while
they decode (no collective runs until the reshard), so each rank samples its own prompts and stops
at its own EOS. The peak is the full model in the compute dtype plus one group's KV cache
(plan's memory.kv_cache and memory.generation_weights).

A group is the G = rl.num_generations completions of one prompt, sampled together as one batch of G
rows of the same prompt (no padding) with the model's KV cache: a prefill, then one token a
forward. Its draws come from a CPU generator seeded by (train.seed, the prompt's global slot), so a
completion depends on its prompt's slot only, the same at every world size and micro-batch split.
A row stops at its first stop id (kept, as a target); the rest of the row is padding (mask 0).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shardtune.train.core.sampling import next_token_probs


@contextmanager
def gathered(model: nn.Module, reshard_after_forward: bool):
    """Every FSDP2 unit's parameters gathered for the block (once), resharded after; eval mode."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    was_training = model.training
    model.eval()
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(reshard_after_forward, recurse=False)
        model.train(was_training)


@dataclass
class Group:
    """One prompt's G completions: token ids (G, n) padded with `pad`, mask (G, n), entropy sums (G,)."""
    tokens: torch.Tensor
    mask: torch.Tensor
    entropy_sum: torch.Tensor

    def completion_ids(self) -> list[list[int]]:
        return [row[m].tolist() for row, m in zip(self.tokens, self.mask)]


def _draw(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator):
    """(G,) tokens drawn from (G, V) logits, and each row's entropy of the distribution sampled."""
    if temperature <= 0:
        return logits.argmax(-1), torch.zeros(logits.shape[0])
    probs = torch.stack([next_token_probs(row, temperature, top_p) for row in logits])  # (G, V)
    scaled = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(scaled.exp() * scaled).sum(-1)  # of the temperature-scaled policy (before top_p), as TRL logs
    return torch.multinomial(probs, 1, generator=gen).squeeze(1), entropy


@torch.no_grad()
def sample_group(model: nn.Module, prompt: list[int], num: int, *, max_new_tokens: int, stop_ids, pad_id: int,
                 temperature: float, top_p: float, seed: int) -> Group:
    """`num` completions of `prompt` (ids), KV-cached, drawn as the module docstring says."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    stops = torch.tensor(sorted({int(i) for i in stop_ids}))
    ids = torch.tensor(prompt, dtype=torch.long, device=device).unsqueeze(0).expand(num, -1)  # (G, P)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, logits = out.cache, out.logits[:, -1].float().cpu()
    tokens = torch.full((num, max_new_tokens), pad_id, dtype=torch.long)
    mask = torch.zeros(num, max_new_tokens, dtype=torch.bool)
    entropy = torch.zeros(num)
    done = torch.zeros(num, dtype=torch.bool)
    n = 0
    for t in range(max_new_tokens):
        tok, ent = _draw(logits, temperature, top_p, gen)
        live = ~done
        tokens[live, t], mask[live, t] = tok[live], True
        entropy += torch.where(live, ent, 0.0)
        done |= torch.isin(tok, stops)
        n = t + 1
        if bool(done.all()):
            break
        step = torch.where(live, tok, pad_id).to(device).unsqueeze(1)  # (G, 1)
        out = model(input_ids=step, cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1].float().cpu()
    return Group(tokens=tokens[:, :n], mask=mask[:, :n], entropy_sum=entropy)
