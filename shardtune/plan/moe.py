"""Mixture-of-experts math of the planner: the tensors of Qwen3-MoE, GPT-OSS and DeepSeek-V3 decoder
layers (Mixtral's stay in params.py), total and active parameters, and the expert states per rank.
Pure Python, imports no torch.

Shapes are transformers 5.25's (`modeling_qwen3_moe.py`, `modeling_gpt_oss.py`,
`modeling_deepseek_v3.py`), per decoder layer i, h hidden, n heads of size d, k KV heads, E routed
experts of intermediate I:

  qwen3_moe    Llama attention + q_norm, k_norm (d,); router (E, h); experts gate_up (E, 2I, h),
               down (E, h, I)                                     (Qwen3 tech report, §2: no shared expert)
  gpt_oss      attention with biases on q/k/v/o and one sink per head (n,); router (E, h) + bias (E,);
               experts gate_up (E, h, 2I) + bias (E, 2I), down (E, I, h) + bias (E, h)
                                                                  (gpt-oss model card §2.1)
  deepseek_v3  multi-head latent attention: q_a (r_q, h), q_a norm (r_q,), q_b (n·(d_nope+d_rope), r_q),
               kv_a (r_kv+d_rope, h), kv_a norm (r_kv,), kv_b (n·(d_nope+d_v), r_kv), o (h, n·d_v);
               the first `first_k_dense_replace` layers a dense SwiGLU of `intermediate_size`, the
               others a router (E, h), E routed experts and `n_shared_experts` shared ones (one SwiGLU
               of S·I)                                            (DeepSeek-V3 report §2.1, Table 1 of app. B)

Active parameters: every tensor except the (E − top-k) routed experts a token skips, with the
embedding and the LM head counted (Qwen's and DeepSeek's convention; OpenAI's gpt-oss figures leave the
input embedding out: tests/unit/test_moe_plan.py).

Expert states: the routed experts' parameters, gradients and optimizer states of one rank, which
expert parallelism divides by ep and FSDP by the remaining data-parallel degree (issue 39:
expert states / (ep × expert-FSDP degree)); without ep the expert-FSDP degree is the strategy's
shard degree.
"""
from __future__ import annotations

from collections.abc import Callable

MOE_TYPES = ("qwen3_moe", "gpt_oss", "deepseek_v3")  # Mixtral: params.py


def moe_fields(cfg: dict, _pos: Callable[..., int]) -> dict:
    """The MoE fields of an Architecture for a Qwen3-MoE, GPT-OSS or DeepSeek-V3 config.json
    (`intermediate_size` becomes the routed expert's, as the activation and FLOP formulas read it);
    `_pos(cfg, key, default=None)` reads a positive integer (params.py's, a UserError otherwise)."""
    mt = cfg["model_type"]
    if mt == "qwen3_moe":
        return {"num_experts": _pos(cfg, "num_experts"), "experts_per_token": _pos(cfg, "num_experts_per_tok"),
                "intermediate_size": _pos(cfg, "moe_intermediate_size"), "qk_norm": True,
                "dense_layers": tuple(cfg.get("mlp_only_layers") or ()),
                "dense_intermediate_size": _pos(cfg, "intermediate_size"),
                "sparse_step": _pos(cfg, "decoder_sparse_step", 1)}
    if mt == "gpt_oss":
        return {"num_experts": _pos(cfg, "num_local_experts"), "experts_per_token": _pos(cfg, "num_experts_per_tok"),
                "intermediate_size": _pos(cfg, "intermediate_size"), "expert_bias": True, "attention_sinks": True}
    # deepseek_v3
    return {"num_experts": _pos(cfg, "n_routed_experts"), "experts_per_token": _pos(cfg, "num_experts_per_tok"),
            "intermediate_size": _pos(cfg, "moe_intermediate_size"),
            "num_shared_experts": int(cfg.get("n_shared_experts") or 0),
            "dense_layers": tuple(range(int(cfg.get("first_k_dense_replace") or 0))),
            "dense_intermediate_size": _pos(cfg, "intermediate_size"),
            "mla": (_pos(cfg, "q_lora_rank"), _pos(cfg, "kv_lora_rank"), _pos(cfg, "qk_nope_head_dim"),
                    _pos(cfg, "qk_rope_head_dim"), _pos(cfg, "v_head_dim"))}


def is_moe_layer(arch, i: int) -> bool:
    """Whether decoder layer i routes (DeepSeek's first layers and Qwen3's mlp_only_layers are dense)."""
    return i not in arch.dense_layers and (i + 1) % arch.sparse_step == 0


def _swiglu(p: str, inner: int, h: int) -> list[tuple[str, tuple]]:
    return [(f"{p}.gate_proj.weight", (inner, h)), (f"{p}.up_proj.weight", (inner, h)),
            (f"{p}.down_proj.weight", (h, inner))]


def attention_tensors(arch, p: str) -> list[tuple[str, tuple]]:
    """(name, shape) of layer prefix `p`'s attention, for the MoE model types."""
    h, n, d, kv = arch.hidden_size, arch.num_heads, arch.head_dim, arch.num_kv_heads
    a = f"{p}.self_attn"
    if arch.mla:
        r_q, r_kv, nope, rope, v = arch.mla
        return [(f"{a}.q_a_proj.weight", (r_q, h)), (f"{a}.q_a_layernorm.weight", (r_q,)),
                (f"{a}.q_b_proj.weight", (n * (nope + rope), r_q)),
                (f"{a}.kv_a_proj_with_mqa.weight", (r_kv + rope, h)),
                (f"{a}.kv_a_layernorm.weight", (r_kv,)), (f"{a}.kv_b_proj.weight", (n * (nope + v), r_kv)),
                (f"{a}.o_proj.weight", (h, n * v))]
    out = []
    for name, rows, cols in (("q_proj", n * d, h), ("k_proj", kv * d, h), ("v_proj", kv * d, h), ("o_proj", h, n * d)):
        out.append((f"{a}.{name}.weight", (rows, cols)))
        if arch.expert_bias:  # gpt-oss: every projection has a bias
            out.append((f"{a}.{name}.bias", (rows,)))
    if arch.qk_norm:
        out += [(f"{a}.q_norm.weight", (d,)), (f"{a}.k_norm.weight", (d,))]
    if arch.attention_sinks:
        out.append((f"{a}.sinks", (n,)))
    return out


def mlp_tensors(arch, p: str, i: int) -> list[tuple[str, tuple]]:
    """(name, shape) of layer i's MLP: dense, or router + routed experts (+ shared experts)."""
    h, E, inner = arch.hidden_size, arch.num_experts, arch.intermediate_size
    m = f"{p}.mlp"
    if not is_moe_layer(arch, i):
        return _swiglu(m, arch.dense_intermediate_size, h)
    if arch.expert_bias:  # gpt-oss: transposed experts, with biases; its router is `router`
        return [(f"{m}.router.weight", (E, h)), (f"{m}.router.bias", (E,)),
                (f"{m}.experts.gate_up_proj", (E, h, 2 * inner)), (f"{m}.experts.gate_up_proj_bias", (E, 2 * inner)),
                (f"{m}.experts.down_proj", (E, inner, h)), (f"{m}.experts.down_proj_bias", (E, h))]
    out = [(f"{m}.gate.weight", (E, h)), (f"{m}.experts.gate_up_proj", (E, 2 * inner, h)),
           (f"{m}.experts.down_proj", (E, h, inner))]
    if arch.num_shared_experts:
        out += _swiglu(f"{m}.shared_experts", arch.num_shared_experts * inner, h)
    return out


def is_routed_expert(name: str) -> bool:
    """A routed experts' tensor (what expert parallelism splits), not the router or shared experts."""
    return ".mlp.experts." in name


def inactive_numel(shapes, arch) -> int:
    """Parameters of the routed experts one token skips: (E − top-k) / E of every routed tensor."""
    if not arch.num_experts:
        return 0
    routed = sum(s.numel for s in shapes if is_routed_expert(s.name))
    return routed * (arch.num_experts - arch.experts_per_token) // arch.num_experts


def expert_state_bytes(states, ep_degree: int = 1) -> int:
    """Expert states per rank: the routed experts' params + grads + optimizer states (`states`, a
    memory.States of the expert tensors alone, already sharded by the expert-FSDP degree) over ep."""
    return -(-(states.params + states.grads + states.optimizer) // ep_degree)


def routed_mlp_bytes(arch, elem_bytes: int = 2, autocast: bool = False) -> tuple[int, int]:
    """(bytes a token, bytes a layer) one MoE layer's router and routed experts keep for backward
    in the trainer's step (docs/planner.md "Activations: derivation", MoE): the fp32 router's input,
    its logits (kept for the aux loss), softmax and the aux loss's softmax, the top-k indices and
    renormalised weights; per routed copy (k a token) the sort's three int64 index buffers, the
    gathered input, gate_up output, SiLU output, product, down output and the fp32 routing weight
    (transformers' grouped_mm forward; under autocast the experts run in the fp32 weights' dtype).
    A layer: the int32 group offsets and, below fp32, the router weight's fp32 copy."""
    h, E, k, I = arch.hidden_size, arch.num_experts, arch.experts_per_token, arch.intermediate_size
    x = 4 if autocast else elem_bytes  # the experts' dtype
    router = 4 * h + 3 * 4 * E + (8 + 4) * k + 4
    routed = k * (3 * 8 + x * (2 * h + 4 * I) + 4)
    return router + routed, 4 * E + (4 * E * h if elem_bytes != 4 and not autocast else 0)


def routed_recompute_bytes(arch, tokens: int) -> int:
    """What an activation-checkpoint recompute of an MoE layer holds beyond the layer's saved
    tensors: the weighted routed rows (k·T, h), fp32 (the routing weights are), alive when the
    recompute stops at the unsort's index, its last saved tensor (torch's early stop)."""
    return 4 * arch.experts_per_token * tokens * arch.hidden_size
