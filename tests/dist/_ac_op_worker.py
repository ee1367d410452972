"""One rank of tests/dist/test_ac_op.py: each case builds the same model twice in these ranks, no
AC and op AC (parallel/build.py), and steps both on the same batches with train_step.

argv: cases.json out_dir. A case: {name, parallel: {...ParallelConfig, without AC}, steps, rows,
seq_len}. Per case it writes both sides' losses, grad norms and the activation bytes saved in step 1.
"""
from __future__ import annotations

import gc

import torch
from _batches import global_batch, rank_micro_batches
from _rank import serve

from shardtune.config import ModelConfig, OptimConfig, ParallelConfig
from shardtune.parallel.build import build_parallel_model
from shardtune.parallel.fsdp import autocast_dtype
from shardtune.parallel.mesh import build_mesh, dp_group
from shardtune.train.core.metrics import SavedActivations
from shardtune.train.core.model import build_meta_model, init_model_weights
from shardtune.train.core.optim import build_optimizer, build_scheduler
from shardtune.train.core.step import StepOptions, global_loss, train_step


def run_case(case: dict, rank: int, world: int) -> dict:
    ocfg = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=1.0, weight_decay=0.0)
    mcfg, out, sides = ModelConfig(), {}, {}
    for ac in ("none", "op"):
        pcfg = ParallelConfig(**case["parallel"], activation_checkpointing=ac)
        mesh = build_mesh(pcfg, world, world, "cpu")
        model = build_parallel_model(build_meta_model(mcfg), pcfg, mesh, torch.device("cpu"),
                                     fill=lambda m: init_model_weights(m, mcfg, 0))
        opt = build_optimizer(model, ocfg, pcfg, dp_group(mesh))
        sides[ac] = (model, opt, build_scheduler(opt, ocfg, case["steps"]), autocast_dtype(pcfg))
        out[f"{ac}_losses"], out[f"{ac}_norms"] = [], []
    for step in range(case["steps"]):
        mbs = rank_micro_batches(global_batch(step, case["rows"], case["seq_len"]), rank, world, 1)
        for ac, (model, opt, sched, cast) in sides.items():
            saved = SavedActivations() if step == 0 else None
            r = train_step(model, opt, sched, mbs, StepOptions(autocast_dtype=cast), dp_group=None, dp_size=world,
                           activations=saved)
            out[f"{ac}_losses"].append(global_loss(r))
            out[f"{ac}_norms"].append(float(r.grad_norm))
            if saved is not None:
                out[f"{ac}_activation_bytes"] = saved.peak_bytes
    del sides
    gc.collect()
    return out


if __name__ == "__main__":
    serve(run_case, timeout_s=300)
