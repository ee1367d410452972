"""One rank of tests/dist/test_chunked_loss_ranks.py: each case builds the same model twice in these
ranks and steps both on the same batches, with train.loss_chunks 1 (the full logits) and K; then
both run validation (rank 1 has no batch: it runs the (1, 2) dummy, which also has fewer rows
than K chunks).

argv: cases.json out_dir. A case: {name, parallel: {...ParallelConfig}, model: catalogue name or
config.json, chunks, steps, rows, seq_len, grad_accum}. Per case it writes both sides' losses,
grad norms, bytes saved for backward in step 1, validation loss and the final parameters'
checksum.
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
from shardtune.train.core.evaluate import evaluate
from shardtune.train.core.metrics import SavedActivations
from shardtune.train.core.model import build_meta_model, init_model_weights
from shardtune.train.core.optim import build_optimizer, build_scheduler
from shardtune.train.core.step import StepOptions, global_loss, train_step


def run_case(case: dict, rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    pcfg = ParallelConfig(**case["parallel"])
    mcfg = ModelConfig(name=case["model"])
    mesh = build_mesh(pcfg, world, world, "cpu")
    amp = autocast_dtype(pcfg)
    ocfg = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=1.0, weight_decay=0.0)
    out: dict = {"grad_accum": case["grad_accum"]}
    sides = {}
    for k in (1, case["chunks"]):
        model = build_parallel_model(build_meta_model(mcfg), pcfg, mesh, torch.device("cpu"),
                                     fill=lambda m: init_model_weights(m, mcfg, 0))
        opt = build_optimizer(model, ocfg, pcfg, dp_group(mesh))
        sides[k] = (model, opt, build_scheduler(opt, ocfg, case["steps"]))
        out[f"losses_{k}"], out[f"norms_{k}"] = [], []
    for step in range(case["steps"]):
        batch = global_batch(step, case["rows"], case["seq_len"])
        mbs = rank_micro_batches(batch, rank, world, case["grad_accum"])
        for k, (model, opt, sched) in sides.items():
            saved = SavedActivations() if step == 0 else None
            r = train_step(model, opt, sched, mbs, StepOptions(loss_chunks=k, autocast_dtype=amp), dp_group=None,
                           dp_size=world, activations=saved)
            if saved is not None:
                out[f"saved_{k}"] = saved.peak_bytes
            out[f"losses_{k}"].append(global_loss(r))
            out[f"norms_{k}"].append(float(r.grad_norm))
    val = [rank_micro_batches(global_batch(100 + i, 2, case["seq_len"]), 0, 1, 1)[0] for i in range(2)]
    for k, (model, _, _) in sides.items():
        out[f"val_{k}"] = evaluate(model, val if rank == 0 else [], torch.device("cpu"),
                                   StepOptions(loss_chunks=k, autocast_dtype=amp))
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double()
                for n, p in model.named_parameters()}
        out[f"param_sum_{k}"] = float(sum(t.abs().sum() for t in full.values()))
    del sides
    gc.collect()
    return out


if __name__ == "__main__":
    serve(run_case)
