"""Text generation that works on a plain transformers model and on an FSDP2-sharded one.

`generate_ids` runs one full forward per new token (no KV cache), so under FSDP2 every rank
gathers the same layers in the same order: each rank must call it in lockstep with the same
input. Sampling draws from a CPU generator seeded with `seed`, the same on every rank; on a
sharded model rank 0's token is also broadcast, so a last-bit difference in logits cannot make
the ranks stop at different steps (a hang). Under tensor parallelism each forward's ids are padded on
the right to a multiple of tp (`_last_logits`); under context parallelism every cp rank runs the
whole sequence with the model's own attention (`unsplit_attention`). Greedy (temperature 0) is transformers'
`generate(do_sample=False)`; temperature / top-p follow its warpers (temperature, then the
smallest set of tokens whose probability reaches top_p, at least one kept).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardtune.parallel.cp import unsplit_attention
from shardtune.parallel.tp import tp_degree


def _is_sharded(model: nn.Module) -> bool:
    return dist.is_available() and dist.is_initialized() and any(
        isinstance(m, FSDPModule) for m in model.modules())


def next_token_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution a token is drawn from (V,): softmax(logits / temperature), cut to top_p."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the tokens ranked above each one
        sorted_p[before >= top_p] = 0.0  # the first token has before = 0: always kept
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return probs / probs.sum()


def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """One token id from the last position's logits (V,), in fp32 on the CPU."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(next_token_probs(logits, temperature, top_p), 1, generator=gen))


def _last_logits(model: nn.Module, ids: torch.Tensor, tp: int) -> torch.Tensor:
    """The logits (V,) after the last of `ids` (1, n). Tensor parallel: the ids padded on the right
    to a multiple of tp (sequence parallelism splits the length over tp; a causal model's logits
    at n − 1 do not see what follows), the vocabulary-sharded logits of that one position gathered."""
    n = ids.shape[1]
    pad = -n % tp
    if pad:
        ids = torch.cat([ids, ids.new_zeros(1, pad)], dim=1)
    with unsplit_attention(model):  # context parallel: the whole sequence on every cp rank
        last = model(input_ids=ids, use_cache=False).logits[0, n - 1]
    return last.full_tensor() if isinstance(last, DTensor) else last


@torch.no_grad()
def generate_ids(model: nn.Module, input_ids: Iterable[int] | torch.Tensor, *, max_new_tokens: int,
                 stop_ids: Iterable[int], temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[int]:
    """The new token ids after `input_ids` (one sequence), ending with the stop id when one was drawn.

    The model is put in eval mode for the call and given back in the mode it had."""
    if max_new_tokens < 0 or temperature < 0.0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"max_new_tokens {max_new_tokens} >= 0, temperature {temperature} >= 0 and "
                         f"top_p {top_p} in (0, 1] are required")
    stops = set(int(i) for i in stop_ids)
    device = next(model.parameters()).device
    ids = torch.as_tensor(list(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids,
                          dtype=torch.long, device=device).reshape(1, -1)
    sharded, tp = _is_sharded(model), tp_degree(model)
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    out: list[int] = []
    try:
        for _ in range(max_new_tokens):
            logits = _last_logits(model, ids, tp).float().cpu()
            token = _pick(logits, temperature, top_p, gen)
            if sharded:  # every rank continues with rank 0's token
                t = torch.tensor([token], dtype=torch.long, device=device)
                dist.broadcast(t, src=0)
                token = int(t.item())
            out.append(token)
            if token in stops:
                break
            ids = torch.cat([ids, torch.tensor([[token]], dtype=torch.long, device=device)], dim=1)
    finally:
        model.train(was_training)
    return out
