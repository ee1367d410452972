"""What checksums cost a checkpoint: save and resume time with and without them, interleaved.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/checkpoint_cost.py \
        [--model tiny-llama] [--pairs 5] [--out /tmp/ckpt_cost]

The real trainer's set-up (zero3, fp32) builds the model, optimizer and state once; then pairs of
saves alternate A B, B A, ... (A: with checksums, B: without), so the load of a shared machine
hits both alike. Resume: `verify_checkpoint` + `load_checkpoint` (A) against `load_checkpoint`
alone (B), also interleaved. Rank 0 prints medians and the ratio A / B of each.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardtune.config import load_recipe
from shardtune.parallel.mesh import build_mesh
from shardtune.train.durable.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from shardtune.train.durable.ckpt_files import read_info
from shardtune.train.rank.context import DistContext
from shardtune.train.rank.loop import set_up


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--out", default="/tmp/ckpt_cost")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_recipe(None, [f"model.name={args.model}", "parallel.precision=fp32", "parallel.strategy=zero3",
                             "data.generated_examples=200", "train.seq_len=64", "train.max_steps=1",
                             f"output_dir={args.out}", "checkpoint.resume=never", "checkpoint.keep=100"])
    ctx = DistContext(rank, world, rank, world, torch.device("cpu"), build_mesh(cfg.parallel, world, world, "cpu"))
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    run = set_up(cfg, ctx, Path(args.out), None)
    times: dict[str, list[float]] = {"save_A": [], "save_B": [], "resume_A": [], "resume_B": []}
    step = 0
    for i in range(args.pairs):
        for with_sums in ((True, False) if i % 2 == 0 else (False, True)):
            step += 1
            dist.barrier()
            t0 = time.perf_counter()
            path = save_checkpoint(cfg.run_dir, step, run.model, run.optimizer, run.scheduler, run.state, rank=rank,
                                   world_size=world, strategy="zero3", cfg_hash="", keep=100, run_id="bench",
                                   checksums=with_sums)
            times["save_A" if with_sums else "save_B"].append(time.perf_counter() - t0)
            info = read_info(path)
            dist.barrier()
            t0 = time.perf_counter()
            if with_sums:
                assert verify_checkpoint(info, rank, world) == []
            load_checkpoint(info, run.model, run.optimizer, run.scheduler, run.state, rank=rank)
            dist.barrier()
            times["resume_A" if with_sums else "resume_B"].append(time.perf_counter() - t0)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        print(f"{args.model}, zero3, {world} gloo ranks, checkpoint {size / 2**20:.1f} MiB, {args.pairs} pairs")
        for what in ("save", "resume"):
            print(f"{what}: with checksums {med[what + '_A'] * 1e3:.1f} ms, without {med[what + '_B'] * 1e3:.1f} ms, "
                  f"ratio {med[what + '_A'] / med[what + '_B']:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
