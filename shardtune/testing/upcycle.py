"""A real mixture of experts to test on: SmolLM2 sparsely upcycled into a Mixtral-shaped HF folder.

Sparse upcycling (Komatsuzaki et al. 2022, "Sparse Upcycling: Training Mixture-of-Experts from
Dense Checkpoints", §3): every dense MLP is copied into E identical experts, a router (new,
random: N(0, initializer_range)) picks top-k of them per token, and the top-k weights are
renormalised to sum to 1, so before any training each MoE layer returns the dense MLP's output
(Σ_i w_i · MLP(x) = MLP(x)) and the logits equal the dense model's. Every other tensor (embeddings,
attention, norms) is copied as stored.

Why Mixtral: its attention is Llama's (q/k/v/o without bias, RoPE, GQA; no sliding window when
`sliding_window` is null), its norms are Llama's RMSNorm, and it ties the LM head to the embedding
when `tie_word_embeddings` is true (SmolLM2 ties). Qwen3-MoE would not give SmolLM2's logits: its
attention adds an RMSNorm to each query and key head (q_norm / k_norm), which a Llama has not.
The expert layout is transformers 5's: `experts.gate_up_proj` [E, 2I, h] = [gate_proj; up_proj] per
expert, `experts.down_proj` [E, h, I].

    python -m shardtune.testing.upcycle [--layers N] [--experts 4] [--top-k 2]   # prints the folder
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from shardtune.testing.smollm2 import TOKENIZER_FILES, _finish, cache_dir, cut_folder, full_folder

# Switch Transformer's and the upcycling paper's load-balancing coefficient (Fedus et al. 2021 §2.2: 1e-2)
AUX_COEF = 0.01
_KEEP = ("architectures", "model_type", "hidden_act", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
         "rms_norm_eps", "rope_parameters", "rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_id",
         "pad_token_id", "initializer_range", "attention_dropout", "torch_dtype")


def mixtral_config(dense: dict, num_experts: int, top_k: int) -> dict:
    """The Mixtral config.json of `dense` (a Llama config.json) upcycled to `num_experts`, top-k."""
    if dense.get("model_type") != "llama" or dense.get("attention_bias") or dense.get("mlp_bias"):
        raise ValueError("sparse upcycling here takes a Llama without attention or MLP biases")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top-k {top_k} must be between 1 and the number of experts {num_experts}")
    cfg = {k: dense[k] for k in _KEEP if k in dense}
    cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=num_experts,
               num_experts_per_tok=top_k, router_aux_loss_coef=AUX_COEF, router_jitter_noise=0.0,
               sliding_window=None, output_router_logits=False,
               head_dim=dense.get("head_dim") or dense["hidden_size"] // dense["num_attention_heads"])
    return cfg


def upcycled_tensors(dense: dict, num_experts: int, seed: int = 0, std: float = 0.02) -> dict:
    """The Mixtral state dict (name → tensor, in each tensor's stored dtype) of a Llama state dict."""
    import torch  # noqa: PLC0415 torch only to build a folder

    out, gen = {}, torch.Generator().manual_seed(seed)
    for name, t in dense.items():
        prefix, _, rest = name.partition(".mlp.")
        if not rest:
            out[name] = t
        elif rest == "gate_proj.weight":  # [I, h], with up_proj: one [2I, h] per expert
            up = dense[f"{prefix}.mlp.up_proj.weight"]
            out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.cat([t, up]).expand(num_experts, -1, -1).contiguous()
            hidden = t.shape[1]
            router = torch.empty(num_experts, hidden).normal_(0.0, std, generator=gen)
            out[f"{prefix}.mlp.gate.weight"] = router.to(t.dtype)
        elif rest == "down_proj.weight":  # [h, I]
            out[f"{prefix}.mlp.experts.down_proj"] = t.expand(num_experts, -1, -1).contiguous()
        elif rest != "up_proj.weight":
            raise ValueError(f"unexpected MLP tensor {name!r}")
    return out


def upcycle(source: Path, target: Path, num_experts: int = 4, top_k: int = 2, seed: int = 0) -> Path:
    """Write the upcycled folder of the Llama HF folder `source` to `target` (config, safetensors,
    tokenizer files); returns `target`."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415 torch only to build a folder

    dense_cfg = json.loads((source / "config.json").read_text())
    cfg = mixtral_config(dense_cfg, num_experts, top_k)
    dense = {k: v for f in sorted(source.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    target.mkdir(parents=True, exist_ok=True)
    tensors = upcycled_tensors(dense, num_experts, seed, float(dense_cfg.get("initializer_range", 0.02)))
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    return target


def upcycled_folder(num_layers: int = 0, num_experts: int = 4, top_k: int = 2, cache: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct (its first `num_layers` layers; 0: all 30) upcycled, built once in the cache."""
    cache = cache or cache_dir()
    source = cut_folder(num_layers, cache) if num_layers else full_folder(cache)
    final = cache / f"{source.name}-moe{num_experts}top{top_k}"
    if (final / ".shardtune-fixture").is_file():
        return final
    tmp = cache / f"{final.name}.tmp{os.getpid()}"  # concurrent builders write apart
    shutil.rmtree(tmp, ignore_errors=True)
    return _finish(upcycle(source, tmp, num_experts, top_k), final)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m shardtune.testing.upcycle", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=0, help="upcycle the first N decoder layers (0: all 30)")
    p.add_argument("--experts", type=int, default=4, help="experts per layer (copies of the dense MLP)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    args = p.parse_args(argv)
    print(upcycled_folder(args.layers, args.experts, args.top_k))


if __name__ == "__main__":
    main()
