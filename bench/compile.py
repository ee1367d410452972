#!/usr/bin/env python
"""train.compile: tokens/s compiled / eager, interleaved in the same ranks, and the compile time.

    .venv/bin/python bench/compile.py                          # 2 ranks, zero3, the bench model, CPU
    .venv/bin/python bench/compile.py --ac full --steps 20
    .venv/bin/python bench/compile.py --nproc 1 --device cuda --precision bf16-mixed --layers 16 --hidden 2048

Relaunches itself under `torch.distributed.run --standalone` (gloo on CPU, OMP_NUM_THREADS=1 per
rank as torchrun sets it; nccl on CUDA). Every rank builds the bench model (bench/throughput.py
`model_config`: 8 layers, hidden 512, byte vocabulary; seeded init) twice with the trainer's own
build (parallel/build.py `build_parallel_model`, compile False / True), and steps both with
train/core/step.py `train_step` on the same random batches, one step of each timed between
barriers, the order alternating (A B, B A, ...) so a shared machine's load hits both alike.
Printed: the first compiled step (dynamo trace + inductor compile + run) against the median eager
step (compile time = their difference), and the median over step pairs of eager / compiled time
(= tokens/s compiled / eager; > 1: compile faster). The inductor cache (/tmp/torchinductor_$USER)
makes a second run's first step shorter: `--fresh-cache` points it at an empty folder.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--strategy", default="zero3")
    ap.add_argument("--ac", default="none", help="parallel.activation_checkpointing")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="timed step pairs after the first")
    ap.add_argument("--fresh-cache", action="store_true", help="an empty inductor cache (cold compile)")
    ap.add_argument("--json", help="write the step times here")
    return ap.parse_args()


def launch(args: argparse.Namespace) -> None:
    from throughput import model_config

    work = Path(tempfile.mkdtemp(prefix="bench-compile-"))
    (work / "config.json").write_text(json.dumps(model_config(args.layers, args.hidden)))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(ROOT),
               BENCH_COMPILE_MODEL=str(work / "config.json"))
    if args.fresh_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           __file__, *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env=env, cwd=ROOT).returncode)


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from shardtune.config import ModelConfig, OptimConfig, ParallelConfig, RunConfig
    from shardtune.parallel.build import build_parallel_model
    from shardtune.parallel.mesh import build_mesh, dp_group
    from shardtune.train.core.model import build_meta_model, init_model_weights
    from shardtune.train.core.optim import build_optimizer, build_scheduler
    from shardtune.train.core.step import StepOptions, train_step

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    pcfg = ParallelConfig(strategy=args.strategy, precision=args.precision, activation_checkpointing=args.ac)
    mcfg = ModelConfig(name=os.environ["BENCH_COMPILE_MODEL"], init="random")
    ocfg = OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant")
    mesh = build_mesh(pcfg, world, int(os.environ["LOCAL_WORLD_SIZE"]), device.type)
    group = dp_group(mesh)
    sides = {}
    for tag, comp in (("eager", False), ("compiled", True)):
        model = build_parallel_model(build_meta_model(mcfg), pcfg, mesh, device,
                                     fill=lambda m: init_model_weights(m, mcfg, 0), compile=comp)
        opt = build_optimizer(model, ocfg, pcfg, group)
        sides[tag] = (model, opt, build_scheduler(opt, ocfg, args.steps + 1))
    gen = torch.Generator().manual_seed(rank)
    vocab = json.loads(Path(os.environ["BENCH_COMPILE_MODEL"]).read_text())["vocab_size"]
    opts = StepOptions.from_config(RunConfig(parallel=pcfg, optim=ocfg), vocab)

    def batch() -> list[dict]:
        ids = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=gen)
        pos = torch.arange(args.seq_len).expand(args.micro_batch, -1)
        return [{"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device), "position_ids": pos.to(device)}]

    def timed(tag: str, mbs: list[dict]) -> float:
        model, opt, sched = sides[tag]
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        r = train_step(model, opt, sched, mbs, opts, dp_group=group, dp_size=world)
        float(r.loss_part)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t0

    first = batch()
    first_eager, first_compiled = timed("eager", first), timed("compiled", first)
    times = {"eager": [], "compiled": []}
    for i in range(args.steps):
        mbs = batch()
        for tag in (("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")):
            times[tag].append(timed(tag, mbs))
    if rank == 0:
        e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
        pairs = [a / b for a, b in zip(times["eager"], times["compiled"])]
        ratio = statistics.median(pairs)
        q1, _, q3 = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else (ratio, ratio, ratio)
        tokens = args.micro_batch * args.seq_len * world
        print(f"bench model {args.layers} layers × hidden {args.hidden}, {args.strategy}, AC {args.ac}, "
              f"{args.precision}, {world} rank(s) on {args.device}, "
              f"micro-batch {args.micro_batch} × seq {args.seq_len}")
        print(f"first step: eager {first_eager:.2f} s, compiled {first_compiled:.2f} s "
              f"(compile ≈ {first_compiled - e:.1f} s)")
        print(f"median step over {args.steps} pairs: eager {e:.3f} s ({tokens / e:,.0f} tokens/s), "
              f"compiled {c:.3f} s ({tokens / c:,.0f} tokens/s)")
        print(f"tokens/s compiled / eager: {ratio:.3f} (median of per-pair ratios; quartiles {q1:.3f}-{q3:.3f})")
        if args.json:
            Path(args.json).write_text(json.dumps({"first_eager_s": first_eager, "first_compiled_s": first_compiled,
                                                   **{f"{k}_s": v for k, v in times.items()}, "ratio": ratio}))
    sides.clear()
    dist.destroy_process_group()


if __name__ == "__main__":
    ns = parse()
    if "RANK" in os.environ:
        rank_main(ns)
    else:
        launch(ns)
