"""One rank of tests/dist/test_simulate_vs_real.py: the trainer's real setup (build_model: meta
build, shard, materialise, random init) per (strategy, grad_accum), one warm-up and one tracked
train step each, measured with torch's trackers (train/core/memtrack.py `track_step`). A case
(`_rank.serve`): {name, cases: [[strategy, grad_accum], ...], seq_len, micro_batch}; it returns
the tracked bytes per "<strategy> ga<grad_accum>"."""
from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from _rank import serve

from shardtune.config import ModelConfig, OptimConfig, ParallelConfig, RunConfig
from shardtune.parallel.mesh import build_mesh, dp_group
from shardtune.strategies import STRATEGY
from shardtune.train.core.memtrack import track_step
from shardtune.train.core.model import build_model, unwrap
from shardtune.train.core.optim import build_optimizer, build_scheduler
from shardtune.train.core.step import StepOptions
from shardtune.verify.simulate import make_step, module_stats_per_micro_batch


def run_case(case: dict, rank: int, world: int) -> dict:
    results = {}
    for strategy, grad_accum in case["cases"]:
        torch.manual_seed(rank)
        pc = ParallelConfig(strategy=strategy, precision="bf16-mixed")
        mesh = build_mesh(pc, world, world, "cpu")
        model = build_model(ModelConfig(name="tiny-llama"), pc, mesh, torch.device("cpu"), seed=0)
        opt = build_optimizer(model, OptimConfig(), pc, dp_group(mesh))
        sched = build_scheduler(opt, OptimConfig(), 10)
        vocab = unwrap(model).config.vocab_size
        step = make_step(model, opt, sched, StepOptions.from_config(RunConfig(parallel=pc), vocab), vocab_size=vocab,
                         seq_len=case["seq_len"], micro_batch=case["micro_batch"], grad_accum=grad_accum,
                         world_size=world)
        # real DDP rebuilds its buckets in the second step's forward (the trace keeps them as built)
        with module_stats_per_micro_batch(model):  # the trackers' per-module stats, per micro-batch
            results[f"{strategy} ga{grad_accum}"] = track_step(
                model, opt, step, fsdp=STRATEGY[strategy].fsdp,
                warmup_steps=1 if STRATEGY[strategy].fsdp else 2)
        del model, opt, sched, step
        gc.collect()  # DDP's reducer before the next strategy / teardown (gloo exit hang)
        dist.barrier()
    return results


if __name__ == "__main__":
    serve(run_case)
