"""`parallel:` — strategy, precision, activation checkpointing, offload, tensor and context parallelism."""
from __future__ import annotations

from pydantic import Field, field_validator

from shardtune.config.base import _Section
from shardtune.strategies import (
    normalize_ac,
    normalize_offload,
    normalize_precision,
    normalize_strategy,
)


class ParallelConfig(_Section):
    strategy: str = Field("zero3", description="ddp | zero1 | zero2 | zero3 | hsdp (FSDP1 names FULL_SHARD, "
                                               "SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD accepted).")
    hsdp_shard_size: int | None = Field(None, ge=1, description="hsdp: ranks per shard group (must divide the "
                                                                "world size). None: processes per node.")
    precision: str = Field("bf16-mixed", description="bf16-mixed (bf16 compute, fp32 master weights and "
                                                     "gradient reduction) | bf16 | fp32.")
    activation_checkpointing: str = Field("none", description="none | full (every decoder layer) | op (every "
                                          "layer, matmul outputs kept, the rest recomputed; docs/ac.md) | "
                                          "layer (every `ac_every`-th layer; `selective` is its old name).")
    ac_every: int = Field(2, ge=1, description="layer AC: checkpoint every k-th decoder layer.")
    offload: str = Field("none", description="none | all (FSDP2 CPUOffloadPolicy: params, grads and optimizer "
                                             "on CPU; FSDP strategies only).")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree (docs/parallelism.md): each layer's matmuls split "
                                         "over tp ranks of a node; data-parallel degree = world / tp.")
    sequence_parallel: bool = Field(True, description="With tp > 1: norms and residuals on sequence shards "
                                                      "(activations / tp; seq_len must divide by tp).")
    tp_across_nodes: bool = Field(False, description="Allow a tp larger than one node's processes (slow links).")
    cp: int = Field(1, ge=1, description="Context-parallel degree (docs/long-context.md): each sequence split over "
                                         "cp ranks; data-parallel degree = world / (tp x cp).")
    ep: int = Field(1, ge=1, description="Expert-parallel degree (docs/moe.md; MoE models): each layer's experts split "
                                         "over ep data-parallel ranks (E/ep each), tokens sent by all-to-all; "
                                         "ep divides dp_shard x cp; experts FSDP-sharded over the rest.")
    activation_offload: bool = Field(False, description="Keep saved activations (with AC full: the block inputs) in "
                                                        "pinned CPU memory until the backward (docs/long-context.md).")
    pp: int = Field(1, ge=1, description="Pipeline-parallel degree (docs/parallelism.md): the decoder layers split "
                                         "into pp stages, the outermost mesh dimension; data-parallel degree = "
                                         "world / (pp x tp x cp).")
    pp_schedule: str = Field("1f1b", description="pp > 1: 1f1b | gpipe | interleaved-1f1b (with pp_virtual_stages); "
                                                 "micro-batches per step = train.grad_accum.")
    pp_virtual_stages: int = Field(1, ge=1, description="interleaved-1f1b: stages per pipeline rank.")
    pp_layers: list[int] | None = Field(None, description="Decoder layers per stage (sums to the model's layers); "
                                                          "None: an even split.")

    _norm = field_validator("strategy")(lambda v: normalize_strategy(v))
    _prec = field_validator("precision")(lambda v: normalize_precision(v))
    _ac = field_validator("activation_checkpointing")(lambda v: normalize_ac(v))
    _off = field_validator("offload")(lambda v: normalize_offload(v))
