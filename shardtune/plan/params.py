"""Exact parameter counts and per-tensor shapes from an HF config (Llama, Mistral, Qwen2, Mixtral; the
other MoE types, Qwen3-MoE, GPT-OSS, DeepSeek-V3: plan/moe.py).

The shapes are the ones transformers 5.x builds (`AutoModelForCausalLM.from_config`), in its
`named_parameters()` order, because the FSDP2 shard sizes depend on each tensor's dim 0
(memory.fsdp2_shard_numel). Per decoder layer of a Llama-style model, with h = hidden size,
n query heads and k KV heads of size d (GQA: k < n), I = intermediate size:

  attention  q (n·d, h) + k (k·d, h) + v (k·d, h) + o (h, n·d)      [+ biases: Qwen2 q/k/v]
  MLP        SwiGLU gate (I, h) + up (I, h) + down (h, I)
             MoE (Mixtral): router (E, h) + experts gate_up (E, 2I, h) + down (E, h, I)
  norms      two RMSNorm weights (h,) — no bias
plus the embedding (V, h), the final norm (h,) and the LM head (V, h) unless tied to the embedding.

Worked example (tested): Llama-2-7B, 32 layers of 4·4096² + 3·4096·11008 + 2·4096 = 202,383,360,
plus 2·32000·4096 + 4096 → 6,738,415,616. Imports no torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from shardtune.errors import UserError
from shardtune.plan import moe
from shardtune.strategies import LORA_TARGETS

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "mixtral", *moe.MOE_TYPES)


@dataclass(frozen=True)
class Architecture:
    """The numbers of an HF config that decide shapes, activations and FLOPs."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    qkv_bias: bool = False  # Qwen2
    attention_bias: bool = False  # Llama `attention_bias`: q, k, v and o
    mlp_bias: bool = False
    num_experts: int = 0  # 0: dense MLP
    experts_per_token: int = 0


@dataclass(frozen=True)
class MoeArchitecture(Architecture):
    """Qwen3-MoE, GPT-OSS and DeepSeek-V3 (plan/moe.py): `intermediate_size` is a routed expert's."""

    qk_norm: bool = False  # Qwen3: RMSNorm on each query and key head
    expert_bias: bool = False  # GPT-OSS: biases on attention, router and experts
    attention_sinks: bool = False  # GPT-OSS: one learned sink logit per head
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (DeepSeek's first k, Qwen3's mlp_only_layers)
    dense_intermediate_size: int = 0
    sparse_step: int = 1  # Qwen3's decoder_sparse_step
    num_shared_experts: int = 0  # DeepSeek: always-on experts beside the routed ones
    mla: tuple[int, ...] | None = None  # DeepSeek: (q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head_dim)


@dataclass(frozen=True)
class ParamShape:
    """One parameter tensor: its name, shape, FSDP group ("root" or the layer index), trainable;
    `nf4`: a QLoRA base weight, stored in NF4 where memory.nf4_stored's rule allows."""

    name: str
    shape: tuple[int, ...]
    group: str | int
    trainable: bool = True
    nf4: bool = False

    @property
    def numel(self) -> int:
        return prod(self.shape)


def _int(cfg: dict, key: str, default=None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UserError(f"config.json: {key!r} must be a positive integer, got {v!r}; fix the model config")
    return v


def architecture_from_config(cfg: dict) -> Architecture:
    """Parse an HF config dict; an unsupported or malformed config is a one-line UserError."""
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_TYPES:
        raise UserError(f"model_type {mt!r} is not supported by the planner; supported: "
                        f"{', '.join(SUPPORTED_TYPES)} (or give --params for model states only)")
    h, n = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    kv = _int(cfg, "num_key_value_heads", n)
    head_dim = cfg.get("head_dim") or (h // n if h % n == 0 else None)
    if head_dim is None:
        raise UserError(f"config.json: hidden_size {h} is not divisible by num_attention_heads {n}; fix the model "
                        "config")
    if n % kv:
        raise UserError(f"config.json: num_attention_heads {n} is not a multiple of num_key_value_heads {kv}")
    experts = _int(cfg, "num_local_experts") if mt == "mixtral" else 0
    if mt in moe.MOE_TYPES:
        return MoeArchitecture(
            model_type=mt, hidden_size=h, num_layers=_int(cfg, "num_hidden_layers"), num_heads=n, num_kv_heads=kv,
            head_dim=_int({"head_dim": head_dim}, "head_dim"), vocab_size=_int(cfg, "vocab_size"),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), **moe.moe_fields(cfg, _int))
    return Architecture(
        model_type=mt, hidden_size=h, intermediate_size=_int(cfg, "intermediate_size"),
        num_layers=_int(cfg, "num_hidden_layers"), num_heads=n, num_kv_heads=kv,
        head_dim=_int({"head_dim": head_dim}, "head_dim"), vocab_size=_int(cfg, "vocab_size"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=(mt == "qwen2"),
        attention_bias=bool(cfg.get("attention_bias", False)) if mt == "llama" else False,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if mt == "llama" else False,
        num_experts=experts,
        experts_per_token=_int(cfg, "num_experts_per_tok") if experts else 0,
    )


def _linear(name: str, out_f: int, in_f: int, group, bias: bool) -> list[ParamShape]:
    shapes = [ParamShape(f"{name}.weight", (out_f, in_f), group)]
    if bias:
        shapes.append(ParamShape(f"{name}.bias", (out_f,), group))
    return shapes


def layer_shapes(arch: Architecture, i: int) -> list[ParamShape]:
    """The parameters of decoder layer i, in transformers' order."""
    h, d, I = arch.hidden_size, arch.head_dim, arch.intermediate_size
    p = f"model.layers.{i}"
    if isinstance(arch, MoeArchitecture):
        tensors = moe.attention_tensors(arch, p) + moe.mlp_tensors(arch, p, i)
        norms = [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
        return [ParamShape(name, shape, i) for name, shape in tensors + norms]
    qkv_b = arch.qkv_bias or arch.attention_bias
    s = (_linear(f"{p}.self_attn.q_proj", arch.num_heads * d, h, i, qkv_b)
         + _linear(f"{p}.self_attn.k_proj", arch.num_kv_heads * d, h, i, qkv_b)
         + _linear(f"{p}.self_attn.v_proj", arch.num_kv_heads * d, h, i, qkv_b)
         + _linear(f"{p}.self_attn.o_proj", h, arch.num_heads * d, i, arch.attention_bias))
    if arch.num_experts:
        E = arch.num_experts
        s += [ParamShape(f"{p}.mlp.gate.weight", (E, h), i),
              ParamShape(f"{p}.mlp.experts.gate_up_proj", (E, 2 * I, h), i),
              ParamShape(f"{p}.mlp.experts.down_proj", (E, h, I), i)]
    else:
        s += (_linear(f"{p}.mlp.gate_proj", I, h, i, arch.mlp_bias)
              + _linear(f"{p}.mlp.up_proj", I, h, i, arch.mlp_bias)
              + _linear(f"{p}.mlp.down_proj", h, I, i, arch.mlp_bias))
    s += [ParamShape(f"{p}.input_layernorm.weight", (h,), i),
          ParamShape(f"{p}.post_attention_layernorm.weight", (h,), i)]
    return s


def param_shapes(arch: Architecture) -> list[ParamShape]:
    """Every parameter of the model (tied embeddings counted once), grouped as FSDP wraps them:
    one group per decoder layer, the rest (embedding, final norm, LM head) in the root group."""
    shapes = [ParamShape("model.embed_tokens.weight", (arch.vocab_size, arch.hidden_size), "root")]
    for i in range(arch.num_layers):
        shapes += layer_shapes(arch, i)
    shapes.append(ParamShape("model.norm.weight", (arch.hidden_size,), "root"))
    if not arch.tie_embeddings:
        shapes.append(ParamShape("lm_head.weight", (arch.vocab_size, arch.hidden_size), "root"))
    return shapes


def lora_shapes(arch: Architecture, rank: int, targets: Sequence[str] = LORA_TARGETS) -> list[ParamShape]:
    """PEFT LoRA adapters: per targeted nn.Linear (out, in), lora_A (r, in) and lora_B (out, r).

    Mixtral's experts are fused 3-D parameters in transformers 5 (not nn.Linear), so only the
    attention projections of MoE models are targeted.
    """
    out = []
    for i in range(arch.num_layers):
        for ps in layer_shapes(arch, i):
            mod = ps.name.rsplit(".", 2)
            if len(ps.shape) == 2 and ps.name.endswith(".weight") and mod[-2] in targets:
                base = ps.name[: -len(".weight")]
                o, n = ps.shape
                out.append(ParamShape(f"{base}.lora_A.default.weight", (rank, n), i))
                out.append(ParamShape(f"{base}.lora_B.default.weight", (o, rank), i))
    return out


def expert_lora_shapes(arch: Architecture, rank: int, targets: Sequence[str]) -> list[ParamShape]:
    """PEFT's ParamWrapper adapters on 3-D expert weights (`lora.target_parameters`, a suffix of the
    weight's name): W [E, d1, d2] gets A [E·r, in] and B [out, E·r], in = d2 and out = d1 (GPT-OSS's
    transposed experts: in = d1, out = d2), r·E·(d1 + d2) parameters (docs/moe.md)."""
    out = []
    for i in range(arch.num_layers):
        for ps in layer_shapes(arch, i):
            if len(ps.shape) == 3 and any(ps.name.endswith(f".{t}") for t in targets):
                E, d1, d2 = ps.shape
                n, o = (d1, d2) if getattr(arch, "expert_bias", False) else (d2, d1)
                out += [ParamShape(f"{ps.name}.lora_A.default.weight", (E * rank, n), i),
                        ParamShape(f"{ps.name}.lora_B.default.weight", (o, E * rank), i)]
    return out


def model_shapes(arch: Architecture, lora_rank: int = 0, quantize_base: str = "none",
                 target_parameters: Sequence[str] = (), target_modules: Sequence[str] = LORA_TARGETS
                 ) -> list[ParamShape]:
    """All tensors the trained model holds; with LoRA the base weights are frozen. `quantize_base`
    "nf4" (QLoRA) marks each adapted base weight `nf4` (train/core/qlora.py: the target nn.Linear
    weights; embeddings, norms, head and biases stay in their dtype). `target_parameters`: LoRA on
    the named 3-D expert weights too (`expert_lora_shapes`); `target_modules`: the nn.Linear ones."""
    if quantize_base not in ("none", "nf4"):
        raise ValueError(f"quantize_base {quantize_base!r}")
    base = param_shapes(arch)
    if lora_rank <= 0:
        return base
    adapters = lora_shapes(arch, lora_rank, target_modules)
    targets = {f"{a.name.split('.lora_A.')[0]}.weight" for a in adapters if ".lora_A." in a.name}
    frozen = [ParamShape(p.name, p.shape, p.group, trainable=False,
                         nf4=quantize_base == "nf4" and p.name in targets) for p in base]
    return frozen + adapters + expert_lora_shapes(arch, lora_rank, target_parameters)


def count_params(arch: Architecture) -> int:
    """Total parameters (transformers' `sum(p.numel() for p in model.parameters())`)."""
    return sum(p.numel for p in param_shapes(arch))


def count_active_params(arch: Architecture) -> int:
    """Parameters one token uses: for MoE, the router and `experts_per_token` of the experts."""
    total = count_params(arch)
    if not arch.num_experts:
        return total
    if isinstance(arch, MoeArchitecture):
        return total - moe.inactive_numel(param_shapes(arch), arch)
    per_expert = 3 * arch.intermediate_size * arch.hidden_size
    return total - arch.num_layers * (arch.num_experts - arch.experts_per_token) * per_expert
