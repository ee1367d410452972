"""Tensor parallelism's model rule: what tp splits of a model must divide evenly. The config,
the planner (plan/tp.py), `Layout.check_model` (launch, preflight) and parallel/tp.py call it.
Imports no torch.
"""
from __future__ import annotations

from shardtune.errors import UserError


def check_tp_model(tp: int, hf: dict, seq_len: int | None = None, sequence_parallel: bool = True) -> None:
    """tp divides what it splits (attention and KV heads, the MLP's intermediate size, the
    vocabulary: no padding is done) and, with sequence parallelism, the sequence length; a
    model with tied embeddings is refused (the embedding and the head would each shard their
    own copy of the one weight). `hf`: the model's config.json values;
    `seq_len` None: not checked."""
    if tp == 1:
        return
    for key, what in (("num_attention_heads", "attention heads"), ("num_key_value_heads", "KV heads"),
                      ("intermediate_size", "the MLP's intermediate size"), ("vocab_size", "the vocabulary")):
        n = hf.get(key, hf.get("num_attention_heads") if key == "num_key_value_heads" else None)
        if n is not None and n % tp:
            raise UserError(f"tp {tp} does not divide {what} ({key} {n}; no padding is done): choose a tp "
                            f"that divides {n} (parallel.tp / --tp)")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise UserError(f"sequence parallelism splits train.seq_len {seq_len} over tp {tp}: make it a multiple "
                        f"of {tp}, or parallel.sequence_parallel=false")
