"""Weights stored under the Hub's names rather than the model's own: a Mixtral or Qwen3-MoE folder
holds one 2-D tensor per expert (`block_sparse_moe.experts.N.w1/w2/w3`, `mlp.experts.N.gate_proj/
up_proj/down_proj`), which transformers' classes fuse into 3-D `experts.gate_up_proj` / `down_proj`
when loading (its conversion mapping). Which file rows make which rows of a model tensor is asked of
transformers itself: its save path (`revert_weight_conversion`) is run on index tensors, so every
rename, merge and concatenation is transformers' own (docs/moe.md "Hub layout")."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from shardtune.errors import UserError

_ID = 40  # a probe value is (parameter number << 40) + flat position in the parameter's leading dims


def _meta(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _keep(p: torch.Tensor) -> int:
    """Leading dims a probe keeps: (experts, rows) of a 3-D expert tensor, the rows of any other."""
    return 2 if p.ndim >= 3 else min(p.ndim, 1)


Sources = tuple[tuple[int, ...], list[tuple[str, torch.Tensor]]]


def hub_sources(config, on_disk: Mapping[str, tuple[int, ...]]) -> dict[str, Sources]:
    """model name → (its full shape, [(file key, positions)]) for each model tensor stored under
    other names: file row i of `key` is flat position positions[i] of the tensor's leading dims
    (`_keep`). Shapes are checked against the files; names stored as they are get no entry."""
    try:
        meta = _meta(config)
    except Exception:  # noqa: BLE001 a class transformers cannot build here (remote code): the names stay missing
        return {}
    params = dict(meta.named_parameters())
    names = list(params)
    probe = {}
    for i, (n, p) in enumerate(params.items()):
        lead = p.shape[:_keep(p)]
        probe[n] = (torch.arange(math.prod(lead)) + (i << _ID)).reshape((*lead, *[1] * (p.ndim - len(lead))))
    out: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for key, t in revert_weight_conversion(meta, probe).items():
        flat = t.reshape(-1)
        owner = names[int(flat[0]) >> _ID]
        if owner in on_disk or key not in on_disk:
            continue
        p = params[owner]
        mixed = bool(((flat >> _ID) != (int(flat[0]) >> _ID)).any())
        if mixed or tuple(on_disk[key]) != (flat.numel(), *p.shape[_keep(p):]):
            raise UserError(f"weights tensor {key!r} has shape {list(on_disk[key])}, which does not make "
                            f"{owner!r} {list(p.shape)} as transformers converts it; give a matching checkpoint")
        out.setdefault(owner, []).append((key, flat & ((1 << _ID) - 1)))
    for owner, srcs in out.items():
        p = params[owner]
        got = torch.sort(torch.cat([pos for _, pos in srcs])).values
        if not torch.equal(got, torch.arange(math.prod(p.shape[:_keep(p)]))):
            raise UserError(f"weights hold only part of {owner!r} ({', '.join(k for k, _ in srcs[:2])}, ...); "
                            "give a complete checkpoint")
    return {owner: (tuple(params[owner].shape), srcs) for owner, srcs in out.items()}


def read_rows(sources: Sources, where: Mapping[str, Path], rows: slice | None) -> torch.Tensor:
    """Dim-0 `rows` (all when None) of a model tensor from its `hub_sources` entry: only the
    file rows they need are read (a rank's experts)."""
    shape, sources = sources
    keep = 2 if len(shape) >= 3 else min(len(shape), 1)
    per = math.prod(shape[1:keep])  # flat positions per dim-0 row
    a, b = (0, shape[0]) if rows is None else (rows.start, rows.stop)
    parts, files = [], {}
    with contextlib.ExitStack() as stack:  # each file opened once per call (a shard's header parsed once)
        for key, pos in sources:
            idx = ((pos >= a * per) & (pos < b * per)).nonzero().flatten()
            if idx.numel() == 0:
                continue
            if where[key] not in files:
                files[where[key]] = stack.enter_context(safe_open(str(where[key]), framework="pt"))
            lo, hi = int(idx.min()), int(idx.max()) + 1
            parts.append((pos[idx] - a * per, files[where[key]].get_slice(key)[lo:hi][idx - lo]))
    out = torch.empty(((b - a) * per, *shape[keep:]), dtype=parts[0][1].dtype)
    for at, data in parts:
        out[at] = data
    return out.view((b - a, *shape[1:]))


def saved_names(config, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's tensors under the names (and splits) transformers' `save_pretrained` writes."""
    return revert_weight_conversion(_meta(config), tensors)


def stores_saved_names(config, names: set[str]) -> bool:
    """Whether a folder holding tensors `names` stores some of the model's tensors under other
    names (the Hub's, which `saved_names` writes back)."""
    return any(n not in names for n, _ in _meta(config).named_parameters())
