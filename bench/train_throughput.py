"""shardtune's zero3 training step vs a minimal hand-written FSDP2 loop: same model, data, ranks.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/train_throughput.py [--steps 60]

Both sides: tiny-llama (catalogue), fp32, AdamW, grad clipping at 1.0, the same synthetic batches.
The hand-written side is the FSDP2 tutorial loop (fully_shard per decoder layer + root, forward,
mean cross-entropy, backward, clip, step). shardtune's side is `build_model` + `train_step` (which
adds the global token count and loss all-reduces and the lr schedule). Both models live side by
side and their steps interleave (A B, B A, ...), so the load of a shared machine hits both alike;
the ratio is hand-written time / shardtune time over all timed steps (> 1: shardtune faster),
with the median of the per-step-pair ratios beside it. Rank 0 prints the result.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def batches(n: int, rows: int, seq_len: int, rank: int, world: int) -> list[dict]:
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 256, (rows * world, seq_len), generator=g)[rank * rows:(rank + 1) * rows]
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = -100
        out.append({"input_ids": ids, "labels": labels,
                    "position_ids": torch.arange(seq_len).expand(rows, -1).clone()})
    return out


def build_hand_written():
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from shardtune.config import ModelConfig
    from shardtune.train.core.model import build_hf_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_hf_config(ModelConfig()), attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))

    def step(b: dict) -> None:
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        loss.item()

    return step


def build_shardtune(mesh, world: int, steps: int):
    from shardtune.config import ModelConfig, OptimConfig, ParallelConfig, RunConfig
    from shardtune.train.core.model import build_model
    from shardtune.train.core.optim import build_optimizer, build_scheduler
    from shardtune.train.core.step import StepOptions, train_step

    pcfg = ParallelConfig(strategy="zero3", precision="fp32")
    ocfg = OptimConfig(lr=1e-4, grad_clip=1.0)
    model = build_model(ModelConfig(), pcfg, mesh, torch.device("cpu"), seed=0)
    model.train()
    opt = build_optimizer(model, ocfg, pcfg)
    sched = build_scheduler(opt, ocfg, steps)
    opts = StepOptions.from_config(RunConfig(parallel=pcfg, optim=ocfg), model.config.vocab_size)

    def step(b: dict) -> None:
        train_step(model, opt, sched, [b], opts, dp_group=None, dp_size=world)

    return step


def timed(step, b: dict) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step(b)
    dist.barrier()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    from shardtune.config import ParallelConfig
    from shardtune.parallel.mesh import build_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = build_mesh(ParallelConfig(strategy="zero3", precision="fp32"), world, world, "cpu")
    data = batches(args.warmup + args.steps, args.micro_batch, args.seq_len, rank, world)
    hand, ours = build_hand_written(), build_shardtune(mesh, world, len(data))
    hand_s, ours_s = [], []
    for i, b in enumerate(data):
        if i % 2 == 0:
            h, o = timed(hand, b), timed(ours, b)
        else:
            o, h = timed(ours, b), timed(hand, b)
        if i >= args.warmup:
            hand_s.append(h)
            ours_s.append(o)
    if rank == 0:
        tok = args.micro_batch * args.seq_len * world
        ratio = sum(hand_s) / sum(ours_s)
        median = statistics.median(h / o for h, o in zip(hand_s, ours_s))
        print(f"zero3, {world} ranks, tiny-llama fp32, micro-batch {args.micro_batch} x {args.seq_len} "
              f"tokens, {args.steps} interleaved steps each: hand-written FSDP2 "
              f"{tok * len(hand_s) / sum(hand_s):,.0f} tokens/s, shardtune {tok * len(ours_s) / sum(ours_s):,.0f} "
              f"tokens/s, ratio {ratio:.3f} (median per step {median:.3f}; target >= 0.97)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
