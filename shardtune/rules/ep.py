"""Expert parallelism's rules (parallel.ep / --ep; docs/moe.md): what ep composes with
(`check_ep`, from rules.combination.check_combination), what it needs of the model (`check_ep_model`,
from `Layout.check_model`: launch, preflight, plan). The degrees themselves (ep divides dp_shard × cp)
are layout.Layout.build's. Imports no torch.
"""
from __future__ import annotations

from shardtune.errors import UserError, positive_int, refuse_first
from shardtune.strategies import FSDP_STRATEGIES, Strategy

EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # config.json: routed experts per layer


def experts_per_layer(hf: dict) -> int:
    """Routed experts per MoE layer from config.json values (0: a dense model)."""
    return next((int(hf[k]) for k in EXPERT_KEYS if int(hf.get(k) or 0) > 0), 0)


def check_ep(s: Strategy, ep: int, *, tp: int = 1, cp: int = 1, lora_rank: int = 0, lora_experts: bool = False,
             quantize_base: str = "none") -> None:
    """What ep > 1 does not compose with yet, one line each: a strategy without FSDP2 (the experts
    shard over their own expert-FSDP mesh), tp, cp (the aux loss's counts and the dispatch would
    have to span the cp ranks), LoRA on the experts (PEFT's adapters hold every expert, not the
    rank's E/ep) and QLoRA (not checked under ep). LoRA on the other modules runs (docs/moe.md)."""
    if positive_int(ep, "expert-parallel degree", "parallel.ep / --ep") == 1:
        return
    refused = (
        (not s.fsdp, f"strategy {s.name!r} (experts are FSDP2-sharded over their own mesh): use "
                     f"{', '.join(FSDP_STRATEGIES)} (parallel.strategy / --strategy)"),
        (tp > 1, f"parallel.tp {tp} (not built yet): set parallel.tp 1 / --tp 1"),
        (cp > 1, f"parallel.cp {cp} (not built yet): set parallel.cp 1 / --cp 1"),
        (lora_rank > 0 and lora_experts, "LoRA on the experts (lora.target_parameters: adapters on split experts "
                                         "are not built yet): lora.target_parameters [], or parallel.ep 1"),
        (lora_rank > 0 and quantize_base != "none", f"QLoRA (lora.quantize_base {quantize_base}, not checked under "
                                                    "ep): lora.quantize_base none, or parallel.ep 1"),
    )
    refuse_first(f"parallel.ep {ep} does not compose with", refused)


def check_ep_model(ep: int, hf: dict) -> None:
    """ep > 1 needs a mixture-of-experts model whose experts per layer it divides (`hf`: config.json)."""
    if ep <= 1:
        return
    n = experts_per_layer(hf)
    if not n:
        raise UserError(f"parallel.ep {ep} needs a mixture-of-experts model; {hf.get('model_type', 'this model')!r} "
                        "has no experts: set parallel.ep 1 / --ep 1")
    if n % ep:
        raise UserError(f"parallel.ep {ep} does not divide the {n} experts per layer; use an ep that divides {n} "
                        "(parallel.ep / --ep)")

