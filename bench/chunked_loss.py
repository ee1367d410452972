#!/usr/bin/env python
"""Chunked cross-entropy (train.loss_chunks) vs the full logits: time and peak bytes, side by side.

The LM head and loss alone (hidden (T, h) → logits (T, V) → summed cross-entropy, forward and
backward), at a head shape of a real model, fp32 or bf16, on CPU (or CUDA when present). Each
round times K = 1 (the step's full computation: h·Wᵀ, .float(), F.cross_entropy) and each K of
--chunks in an interleaved order, so drifting machine load hits every variant alike; reported:
median time ratio to K = 1, and the peak bytes torch's MemTracker sees in forward+backward above
the inputs (the logits term), with the planner's head term (plan/activations.py) beside it.

    .venv/bin/python bench/chunked_loss.py                                  # SmolLM2 head, T 2048
    .venv/bin/python bench/chunked_loss.py --hidden 4096 --vocab 128256 --tokens 1024 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shardtune.train.core.chunked_loss import chunked_cross_entropy  # noqa: E402


def full_loss(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t, reduction="sum")


def run(k, h, w, t):
    h.grad = w.grad = None
    loss = full_loss(h, w, t) if k == 1 else chunked_cross_entropy(h, w, t, k)
    loss.backward()
    if h.device.type == "cuda":
        torch.cuda.synchronize()


def peak_bytes(k, h, w, t) -> int:
    run(k, h, w, t)  # grads exist: the tracked run starts at rest
    tracker = MemTracker()
    tracker.track_external(h, w)
    with tracker:
        run(k, h, w, t)
    snap = tracker.get_tracker_snapshot("peak")
    peak = max(int(v.get("Total", 0)) for v in snap.values())
    base = 2 * (h.numel() * h.element_size() + w.numel() * w.element_size())  # inputs and their grads
    return peak - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, generator=g).to(dev, dt).requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, generator=g) * 0.02).to(dev, dt).requires_grad_()
    t = torch.randint(0, a.vocab, (a.tokens,), generator=g).to(dev)
    ks = [1, *a.chunks]
    times: dict[int, list[float]] = {k: [] for k in ks}
    for k in ks:
        run(k, h, w, t)  # warm-up
    for r in range(a.rounds):
        for k in (ks if r % 2 == 0 else ks[::-1]):  # interleaved, alternating order
            t0 = time.perf_counter()
            run(k, h, w, t)
            times[k].append(time.perf_counter() - t0)
    e = h.element_size()
    full_term = (e + 8 if e != 4 else 8) * a.vocab
    print(f"head T={a.tokens} h={a.hidden} V={a.vocab} {a.dtype} on {dev.type}, {a.rounds} interleaved rounds")
    # peak: forward and backward, above the inputs and their grads; planner: the forward-peak
    # activations term of the logits (the backward's chunk temporaries are beyond it)
    print(f"{'K':>4} {'median s':>9} {'time/K=1':>9} {'peak MiB':>9} {'peak/K=1':>9} {'planner logits MiB':>19}")
    base_t, base_p = statistics.median(times[1]), peak_bytes(1, h, w, t)
    for k in ks:
        med, peak = statistics.median(times[k]), peak_bytes(k, h, w, t)
        chunk_row = (e + 4) * a.vocab if e != 4 else 4 * a.vocab  # plan/activations.py head_activation_bytes
        planned = a.tokens * full_term if k == 1 else 4 * a.tokens + -(-a.tokens // k) * chunk_row
        print(f"{k:>4} {med:>9.4f} {med / base_t:>9.2f} {peak / 2**20:>9.1f} {peak / base_p:>9.3f} "
              f"{planned / 2**20:>19.1f}")


if __name__ == "__main__":
    main()
