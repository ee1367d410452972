"""Intra-op threads in one process: the same train step at 1 thread and at every core, alternated.

    .venv/bin/python bench/threads.py [--steps 20] [--layers 4] [--hidden 256] [--json OUT]

What `shardtune train --nproc 1` gains or loses from train.threads' default (cores / ranks on
the node, train/rank/loop.py) against one thread: one model (bench/throughput.py's Llama config,
seeded), one batch, AdamW; steps alternate between torch.set_num_threads(1) and
set_num_threads(cores) (A B, B A, ...), so a shared machine's load hits both alike. Prints the
median per-pair ratio t(1 thread) / t(cores) (> 1: more threads faster), its spread and the load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import model_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**model_config(args.layers, args.hidden)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (args.micro_batch, args.seq_len))

    def step(threads: int) -> float:
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    step(1), step(cores)  # warm-up
    load = os.getloadavg()
    ratios = []
    for i in range(args.steps):
        if i % 2 == 0:
            one, many = step(1), step(cores)
        else:
            many, one = step(cores), step(1)
        ratios.append(one / many)
    out = {"cores": cores, "ratio_1_over_cores": {"median": statistics.median(ratios), "min": min(ratios),
                                                  "max": max(ratios)},
           "steps": args.steps, "load_avg": list(load), "load_avg_after": list(os.getloadavg())}
    r = out["ratio_1_over_cores"]
    print(f"t(1 thread) / t({cores} threads): median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}) "
          f"over {args.steps} pairs; load {load[0]:.1f} -> {out['load_avg_after'][0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
