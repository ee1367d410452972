"""Compute side of the step-time model: FLOPs, recomputation, achievable MFU, optimizer step.

Pure Python, imports no torch. FLOPs are counted as in PaLM (Chowdhery et al. 2022, appendix B):
a training token costs 6N FLOPs for the matmuls (2N forward, 4N backward) plus 12·L·H·Q·T for
attention (forward QKᵀ and AV: 2·2·H·Q·T per layer, backward twice that), with N the parameters
that take part in matmuls (not the input embedding table), L layers, H query heads, Q head
dimension and T the sequence length. MFU is model FLOPs over (step time × peak FLOP/s): the
recomputed forward of activation checkpointing costs time but is not model FLOPs.
"""
from __future__ import annotations

# the PaLM count is shared with the trainer's MFU (rules/flops.py); the planner reads it from here
from shardtune.rules.flops import forward_flops_per_token, matmul_params, model_flops_per_token  # noqa: F401
from shardtune.strategies import checkpointed_layers

# Achievable MFU of a compute-only training step (no exposed communication, no recompute), by GPU
# family. Overridable with `plan --mfu X`. Sources:
#  - H100/H200: Llama 3 (Dubey et al. 2024, Table 4): 38-43 % BF16 MFU on 8K-16K H100s → 0.40.
#  - A100: Narayanan et al. 2021 (Megatron-LM, SC'21, Table 1): 44-52 % of peak on A100 → 0.45.
#  - anything else: 0.35, a cautious guess (say so in the output).
ACHIEVABLE_MFU = {"h100": 0.40, "h200": 0.40, "a100": 0.45}
DEFAULT_MFU = 0.35

# AdamW's update streams per parameter: fp32 param read+write 8, fp32 grad read 4, m and v
# read+write 16 → 28 bytes; the bf16 compute copy FSDP2 casts in the next forward is not part of
# the step. The step is memory-bound (a few FLOPs per 28 bytes), so its time is bytes / HBM BW.
ADAMW_BYTES_PER_PARAM = 28
SGD_BYTES_PER_PARAM = 12  # param read+write 8 + grad read 4 (no momentum)


def achievable_mfu(gpu_name: str | None) -> tuple[float, str]:
    """(MFU assumption, where it comes from) for a GPU catalogue name such as 'h100-80gb'."""
    g = (gpu_name or "").lower()
    for family, mfu in ACHIEVABLE_MFU.items():
        if g.startswith(family) or family in g:
            return mfu, f"default for {family.upper()} (see shardtune/plan/compute.py)"
    return DEFAULT_MFU, "cautious default for an unknown GPU (override with --mfu)"


# op AC's recompute time / the no-AC forward+backward time, measured by bench/recompute.py on the
# CPU: +5.8 % (Llama 8 × 512) and +5.9 % (4 × 1024), fp32, one thread (docs/ac.md "Measured")
OP_RECOMPUTE_SHARE = 0.058


def recompute_flops_per_token(ac: str, layer_matmul_params: int, num_layers: int, num_heads: int,
                              head_dim: int, seq_len: int, ac_every: int = 2,
                              unrecomputed_params_per_layer: int = 0) -> float:
    """Extra FLOPs per token that activation checkpointing spends re-running forwards.

    `full` wraps every decoder layer: each layer's forward runs again in backward, 2·N_layers +
    4·L·H·Q·T (the embedding and LM head are not wrapped). torch's non-reentrant checkpoint stops
    recomputing once every saved tensor backward needs is back (`torch.utils.checkpoint`, early
    stop on by default), so a layer's last matmul — whose output nothing saves — is not re-run:
    pass its size as `unrecomputed_params_per_layer` (Llama: the MLP down projection, I×d).
    `layer` (old name `selective`; torchtitan's layer-selective AC) wraps every `ac_every`-th
    layer: layers 0, k, 2k, ... → ceil(L/k) of L layers are recomputed. `op` keeps every matmul
    and SDPA output and re-runs no matmul; its element-wise recompute (norms, RoPE, SiLU, adds)
    is priced as OP_RECOMPUTE_SHARE of the layers' training FLOPs: its measured time (docs/ac.md).
    """
    if ac == "none":
        return 0.0
    if ac == "op":
        return OP_RECOMPUTE_SHARE * (6.0 * layer_matmul_params + 12.0 * num_layers * num_heads * head_dim * seq_len)
    recomputed = layer_matmul_params / num_layers - unrecomputed_params_per_layer
    per_layer = 2.0 * recomputed + 4.0 * num_heads * head_dim * seq_len
    if ac == "full":
        return per_layer * num_layers
    if ac == "layer":
        return per_layer * len(checkpointed_layers(num_layers, ac, ac_every))  # the trainer's rule
    raise ValueError(f"unknown activation checkpointing mode {ac!r}")


def compute_time_s(flops: float, peak_flops_per_s: float, mfu: float) -> float:
    """Time for `flops` at a fraction `mfu` of the GPU's peak (the achievable rate)."""
    return flops / (peak_flops_per_s * mfu)


def optimizer_step_time_s(params_per_rank: float, mem_bw_bytes_per_s: float,
                          optimizer: str = "adamw") -> float:
    """Memory-bound optimizer update: bytes streamed per parameter / memory bandwidth.

    AdamW streams 28 B/param (see ADAMW_BYTES_PER_PARAM); with optimizer offload the update runs
    on the host and `mem_bw_bytes_per_s` should be this rank's share of host memory bandwidth.
    """
    per_param = SGD_BYTES_PER_PARAM if optimizer == "sgd" else ADAMW_BYTES_PER_PARAM
    return params_per_rank * per_param / mem_bw_bytes_per_s


def offload_transfer_time_s(params_per_rank: float, pcie_bytes_per_s: float,
                            grad_bytes: int = 4, param_bytes: int = 4) -> float:
    """Host↔device copies per step with optimizer offload: gradients down, updated params up.

    FSDP2's CPUOffloadPolicy keeps the sharded fp32 params and grads on the host: each step copies
    the gradient shard to the host and the parameter shard back (4 + 4 B/param at fp32).
    """
    return params_per_rank * (grad_bytes + param_bytes) / pcie_bytes_per_s


def mfu(model_flops_per_step_per_gpu: float, step_time_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: model FLOPs / (time × peak) (PaLM §B; recompute not counted)."""
    return model_flops_per_step_per_gpu / (step_time_s * peak_flops_per_s)
