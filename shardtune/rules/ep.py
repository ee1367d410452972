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


# model types whose router the trainer's fp32 router reproduces (softmax top-k, GPT-OSS's bias; checked
# against transformers in tests/unit/test_moe.py); DeepSeek-V3's sigmoid, group-limited, bias-balanced
# router is not one of them
TRAINED_MOE = ("mixtral", "qwen3_moe", "gpt_oss")


def check_trainable_moe(hf: dict) -> None:
    """The trainer's part (preflight): a mixture of experts whose routing it reproduces, else one line."""
    model_type = hf.get("model_type")
    if experts_per_layer(hf) and model_type not in TRAINED_MOE:
        raise UserError(f"training {model_type!r} mixtures of experts is not built: the trainer's router (train/core/"
                        f"moe.py) is checked for {', '.join(TRAINED_MOE)} only; `shardtune plan` plans it")


def check_ep(s: Strategy, ep: int, *, tp: int = 1, cp: int = 1, lora_rank: int = 0, lora_experts: bool = False,
             quantize_base: str = "none") -> None:
    """What ep > 1 does not compose with yet, one line each: a strategy without FSDP2 (the experts
    shard over their own expert-FSDP mesh), LoRA on the experts (PEFT's adapters hold every expert,
    not the rank's E/ep) and QLoRA (not checked under ep). LoRA on the other modules runs, and tp and
    cp compose (docs/moe.md "ep with tp and cp"); `tp`, `cp` kept for the callers."""
    if positive_int(ep, "expert-parallel degree", "parallel.ep / --ep") == 1:
        return
    refused = (
        (not s.fsdp, f"strategy {s.name!r} (experts are FSDP2-sharded over their own mesh): use "
                     f"{', '.join(FSDP_STRATEGIES)} (parallel.strategy / --strategy)"),
        (lora_rank > 0 and lora_experts, "LoRA on the experts (lora.target_parameters: adapters on split experts "
                                         "are not built yet): lora.target_parameters [], or parallel.ep 1"),
        (lora_rank > 0 and quantize_base != "none", f"QLoRA (lora.quantize_base {quantize_base}, not checked under "
                                                    "ep): lora.quantize_base none, or parallel.ep 1"),
    )
    refuse_first(f"parallel.ep {ep} does not compose with", refused)


def check_ep_model(ep: int, hf: dict, tp: int = 1, seq_len: int | None = None, sequence_parallel: bool = True,
                   cp: int = 1) -> None:
    """ep > 1 needs a mixture-of-experts model whose experts per layer it divides (`hf`: config.json);
    tp > 1 on a MoE model needs ep > 1 (the experts are not tp-split: each tp rank routes its own
    1/tp of the tokens through the expert-parallel dispatch), and without sequence parallelism a
    sequence that tp divides (the MoE block takes Shard(1) of it). GPT-OSS runs without tp and cp only."""
    n = experts_per_layer(hf)
    k = int(hf.get("num_experts_per_tok") or 0)
    if n and k > n:
        raise UserError(f"config.json's num_experts_per_tok {k} exceeds the {n} experts per layer: each token's top-k "
                        f"picks k distinct experts; give a model folder with num_experts_per_tok <= {n}")
    if hf.get("model_type") == "gpt_oss" and (tp > 1 or cp > 1):
        raise UserError(f"parallel.{'tp' if tp > 1 else 'cp'} {max(tp, cp)} with GPT-OSS is not built: its attention "
                        "sinks need eager attention (no tp or cp path here); set parallel.tp 1 and parallel.cp 1")
    if tp > 1 and n and ep <= 1:
        raise UserError(f"parallel.tp {tp} on a mixture-of-experts model needs expert parallelism (the experts are "
                        "not tp-split): set parallel.ep / --ep > 1, or parallel.tp 1 / --tp 1")
    if tp > 1 and n and not sequence_parallel and seq_len is not None and seq_len % tp:
        raise UserError(f"parallel.tp {tp} with experts splits each sequence's tokens over the tp ranks: make "
                        f"train.seq_len {seq_len} a multiple of {tp}")
    if ep <= 1:
        return
    if not n:
        raise UserError(f"parallel.ep {ep} needs a mixture-of-experts model; {hf.get('model_type', 'this model')!r} "
                        "has no experts: set parallel.ep 1 / --ep 1")
    if n % ep:
        raise UserError(f"parallel.ep {ep} does not divide the {n} experts per layer; use an ep that divides {n} "
                        "(parallel.ep / --ep)")

