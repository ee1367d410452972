"""One rank of tests/dist/test_compile.py: each case builds the same model twice in these ranks,
eager and `compile=True` (parallel/build.py), and steps both on the same batches; then the compiled
one runs validation (a rank short of batches runs the (1, 2) dummy) and sample generation.

argv: cases.json out_dir. A case: {name, parallel: {...ParallelConfig}, lora: {...LoraConfig} | absent,
steps, rows, seq_len}. Per case it writes the losses and grad norms of both, both models'
state-dict keys, the activation bytes saved in step 1, and dynamo's graph count before/after.
"""
from __future__ import annotations

import gc

import torch
import torch._dynamo.utils as dynamo_utils
from _batches import global_batch, rank_micro_batches
from _rank import serve

from shardtune.config import LoraConfig, ModelConfig, OptimConfig, ParallelConfig
from shardtune.parallel.build import build_parallel_model
from shardtune.parallel.mesh import build_mesh, dp_group
from shardtune.train.core.evaluate import evaluate
from shardtune.train.core.lora import apply_lora
from shardtune.train.core.metrics import SavedActivations
from shardtune.train.core.model import build_meta_model, init_model_weights
from shardtune.train.core.optim import build_optimizer, build_scheduler
from shardtune.train.core.sampling import generate_ids
from shardtune.train.core.step import StepOptions, global_loss, train_step


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompile adds one)."""
    return int(dynamo_utils.counters["stats"]["unique_graphs"])


def build(case: dict, mesh, compile: bool):
    """train/core/model.py build_model's steps, with `compile` passed to build_parallel_model."""
    mcfg, pcfg = ModelConfig(), ParallelConfig(**case["parallel"])
    model = build_meta_model(mcfg)
    if case.get("lora"):
        apply_lora(model, LoraConfig(**case["lora"]))
    return build_parallel_model(model, pcfg, mesh, torch.device("cpu"),
                                fill=lambda m: init_model_weights(m, mcfg, 0), compile=compile)


def run_case(case: dict, rank: int, world: int) -> dict:
    pcfg = ParallelConfig(**case["parallel"])
    mesh = build_mesh(pcfg, world, world, "cpu")
    ocfg = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=1.0, weight_decay=0.0)
    if case.get("fresh_dynamo"):  # as in a fresh process: earlier cases of a shared launch compiled too
        torch._dynamo.reset()  # (torchao's 8-bit AdamW compiles its step)
        dynamo_utils.counters.clear()
    out: dict = {"graphs_before": graphs()}
    sides = {}
    for tag, comp in (("eager", False), ("compiled", True)):
        model = build(case, mesh, comp)
        opt = build_optimizer(model, ocfg, pcfg, dp_group(mesh))
        sides[tag] = (model, opt, build_scheduler(opt, ocfg, case["steps"]))
        out[f"{tag}_keys"] = list(model.state_dict().keys())
        out[f"{tag}_losses"], out[f"{tag}_norms"] = [], []
    for step in range(case["steps"]):
        mbs = rank_micro_batches(global_batch(step, case["rows"], case["seq_len"]), rank, world, 1)
        for tag, (model, opt, sched) in sides.items():
            saved = SavedActivations() if step == 0 else None
            r = train_step(model, opt, sched, mbs, StepOptions(), dp_group=None, dp_size=world, activations=saved)
            out[f"{tag}_losses"].append(global_loss(r))
            out[f"{tag}_norms"].append(float(r.grad_norm))
            if saved is not None:
                out[f"{tag}_activation_bytes"] = saved.peak_bytes
    out["graphs_after_train"] = graphs()
    model = sides["compiled"][0]
    # rank 0 has two validation batches, rank 1 none: rank 1 runs the (1, 2) dummy twice
    val = [rank_micro_batches(global_batch(100 + i, 2, case["seq_len"]), 0, 1, 1)[0] for i in range(2)]
    out["val_loss"] = evaluate(model, val if rank == 0 else [], torch.device("cpu"), StepOptions())
    out["sample"] = generate_ids(model, [5, 6, 7], max_new_tokens=12, stop_ids=[])
    out["graphs_after_eval"] = graphs()
    del sides, model
    gc.collect()
    return out


if __name__ == "__main__":
    serve(run_case, timeout_s=300)
