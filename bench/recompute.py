#!/usr/bin/env python
"""Recompute cost of activation checkpointing, measured: forward+backward time with none / full /
op / layer AC, steps interleaved in one process, median ratios against none.

    .venv/bin/python bench/recompute.py                       # CPU, bench model, 1 thread
    .venv/bin/python bench/recompute.py --device cuda --dtype bfloat16 --layers 16 --hidden 2048

One model per mode, all from the same seed (bench/throughput.py `model_config`: 8 layers, hidden
512, SwiGLU, GQA 2:1, byte vocabulary; SDPA), AC applied by the trainer's own
parallel/ac.py `apply_activation_checkpointing` (layer: every `--ac-every`-th layer). Each
round times one forward+backward of every mode on the same batch (packed rows: position ids
restart mid-row, as the trainer packs, so transformers builds its block mask), in an order that
rotates round by round so a shared machine's drift hits all alike; ratios are taken within a
round and the median over rounds printed (CPU: the process's CPU time, one thread, so a shared
machine's other jobs do not enter it; CUDA: wall time), beside the planner's FLOP-based prediction
(plan/compute.py `recompute_flops_per_token` over PaLM's 6N + 12·L·H·Q·T). docs/ac.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from throughput import model_config  # noqa: E402

from shardtune.parallel.ac import apply_activation_checkpointing  # noqa: E402
from shardtune.plan import compute as C  # noqa: E402

MODES = ("none", "full", "op", "layer")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--ac-every", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12, help="timed rounds after one warm-up round")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the 2-core machines are shared)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--json", help="write the step times here")
    return ap.parse_args()


def build(cfg: dict, mode: str, args) -> torch.nn.Module:
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.config.use_cache = False
    model.to(device=args.device, dtype=getattr(torch, args.dtype)).train()
    apply_activation_checkpointing(model, mode, args.ac_every)
    return model


def predicted(cfg: dict, args) -> dict:
    """The planner's (model + recompute) / model FLOPs per token, per mode (plan/timing.py's count)."""
    h, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    H, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    Q = h // H
    layer = 2 * h * H * Q + 2 * h * kv * Q + 3 * h * i
    n_mm = L * layer + v * h  # + the LM head (untied)
    model = C.model_flops_per_token(n_mm, L, H, Q, args.seq_len)
    return {m: 1 + C.recompute_flops_per_token(m, L * layer, L, H, Q, args.seq_len, args.ac_every, i * h) / model
            for m in MODES}


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    cfg = model_config(args.layers, args.hidden)
    models = {m: build(cfg, m, args) for m in MODES}
    g = torch.Generator().manual_seed(1)
    b, s = args.micro_batch, args.seq_len
    ids = torch.randint(0, 256, (b, s), generator=g).to(args.device)
    half = s // 2
    pos = torch.cat([torch.arange(half), torch.arange(s - half)]).repeat(b, 1).to(args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    # CPU: this process's CPU time (one thread: the work itself, blind to the time a shared
    # machine's other jobs take the core away); CUDA: wall time between synchronisations
    clock = time.perf_counter if args.device == "cuda" else time.process_time

    def step(model) -> float:
        sync()
        t0 = clock()
        logits = model(input_ids=ids, position_ids=pos).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
        del logits
        loss.backward()
        sync()
        dt = clock() - t0
        model.zero_grad(set_to_none=True)
        return dt

    times = {m: [] for m in MODES}
    for r in range(args.rounds + 1):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        got = {m: step(models[m]) for m in order}
        if r:  # round 0 warms up
            for m in MODES:
                times[m].append(got[m])
    ratios = {m: statistics.median(t / n for t, n in zip(times[m], times["none"])) for m in MODES}
    pred = predicted(cfg, args)
    print(f"torch {torch.__version__}; Llama {args.layers} x {args.hidden}, {args.dtype}, {args.device}, "
          f"{args.threads} thread(s), micro-batch {b} x {s} tokens (packed rows), layer AC every "
          f"{args.ac_every}; {args.rounds} rounds, order rotating; "
          f"{'wall' if args.device == 'cuda' else 'process CPU'} time")
    print(f"{'mode':6} {'median s':>9} {'ratio vs none':>14} {'planner predicts':>17}")
    for m in MODES:
        print(f"{m:6} {statistics.median(times[m]):9.3f} {ratios[m]:14.3f} {pred[m]:17.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "times": times, "ratios": ratios,
                                               "predicted": pred}, indent=1))


if __name__ == "__main__":
    main()
