"""Training FLOPs per token, the planner's (plan/compute.py, plan/timing.py) and the trainer's
(train/core/metrics.py: MFU) one count. Imports no torch.
"""
from __future__ import annotations


def matmul_params(total_params: int, vocab_size: int, hidden_size: int, tied_embeddings: bool) -> int:
    """Parameters that take part in matmuls: all but the input embedding table.

    With tied embeddings the one table is also the LM head (a matmul), so nothing is removed.
    """
    return total_params if tied_embeddings else total_params - vocab_size * hidden_size


def model_flops_per_token(matmul_params_count: int, num_layers: int, num_heads: int,
                          head_dim: int, seq_len: int) -> float:
    """PaLM appendix B: 6N + 12·L·H·Q·T training FLOPs per token (forward + backward)."""
    return 6.0 * matmul_params_count + 12.0 * num_layers * num_heads * head_dim * seq_len


def forward_flops_per_token(matmul_params_count: int, num_layers: int, num_heads: int,
                            head_dim: int, seq_len: int) -> float:
    """The forward third of PaLM's count: 2N + 4·L·H·Q·T."""
    return 2.0 * matmul_params_count + 4.0 * num_layers * num_heads * head_dim * seq_len
