"""The start-up line (train/core/effective.py `describe`) names every degree the run was built
with: a tp × cp run said only "cp 2" before."""
from __future__ import annotations

from shardtune.train.core.effective import describe

BASE = dict(strategy="zero3", precision="fp32", master_dtype="float32", compute_dtype="float32",
            autocast_dtype=None, activation_checkpointing="none", ac_layers=[], offload="none", compile=False,
            loss_chunks=1, objective="sft", optimizer="adamw (torch, fused)", grad_clip=1.0, lora_rank=0,
            quantize_base="none", threads=1, tp=1, sequence_parallel=False, cp=1, activation_offload=False)


def test_the_line_names_tp_sp_cp_and_activation_offload_when_on():
    assert "tp " not in describe(BASE) and "cp " not in describe(BASE) and "activation offload" not in describe(BASE)
    line = describe({**BASE, "tp": 2, "sequence_parallel": True, "cp": 4, "activation_offload": True})
    assert "tp 2 + SP, cp 4, activation offload on," in line
    assert "tp 2, cp 2," in describe({**BASE, "tp": 2, "cp": 2})
