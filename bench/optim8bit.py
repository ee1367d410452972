#!/usr/bin/env python
"""AdamW kernels and 8-bit AdamW, side by side and interleaved in one run (issue 17 items 2-3).

1. torch AdamW's kernels on a Llama-shaped parameter set (fp32, CPU; or CUDA if present):
   fused (what `optim.implementation: auto` now picks), foreach, for-loop — optimizer steps
   interleaved round by round, median step time and the ratio to fused.
2. adamw-8bit: torchao's AdamW8bit — the first step (torch.compile of one kernel per distinct
   shape) against the later steps, and the state bytes vs fp32 AdamW's.

    .venv/bin/python bench/optim8bit.py                 # hidden 1024, 4 layers
    .venv/bin/python bench/optim8bit.py --hidden 512 --rounds 10
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def llama_params(h: int, layers: int, device: str) -> list[torch.nn.Parameter]:
    i = int(h * 8 / 3) // 64 * 64
    shapes = [(32000, h)] + layers * [(h, h), (h // 4, h), (h // 4, h), (h, h), (i, h), (i, h), (h, i), (h,), (h,)]
    g = torch.Generator().manual_seed(0)
    out = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g).mul_(0.02).to(device))
        p.grad = torch.randn(s, generator=g).to(device)
        out.append(p)
    return out


def timed_step(opt, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}
    opts = {k: torch.optim.AdamW(llama_params(a.hidden, a.layers, device), lr=1e-4, **kw) for k, kw in kernels.items()}
    n = sum(p.numel() for p in opts["fused"].param_groups[0]["params"])
    for o in opts.values():  # states made, caches warm
        timed_step(o, device)
    times = {k: [] for k in opts}
    for _ in range(a.rounds):  # interleaved: each round steps every kernel once
        for k, o in opts.items():
            times[k].append(timed_step(o, device))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"torch AdamW step, {n / 1e6:.1f} M fp32 params on {device}, median of {a.rounds} interleaved rounds")
    for k, v in med.items():
        print(f"  {k:9s} {v * 1e3:8.1f} ms   × fused {v / med['fused']:.2f}")
    del opts
    from torchao.optim import AdamW8bit

    params = llama_params(a.hidden, a.layers, device)
    opt8 = AdamW8bit(params, lr=1e-4)
    first = timed_step(opt8, device)
    later = statistics.median(timed_step(opt8, device) for _ in range(a.rounds))
    shapes = len({(tuple(p.shape), p.numel() >= 4096 and p.numel() % 256 == 0) for p in params})
    def nbytes(t):  # an OptimState8bit: its codes, scales and qmap
        return sum(getattr(t, x).untyped_storage().nbytes() for x in t.__tensor_flatten__()[0]) \
            if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor else t.untyped_storage().nbytes()
    state = sum(nbytes(v) for st in opt8.state.values() for k, v in st.items() if k != "step")
    print(f"torchao AdamW8bit: first step {first:.1f} s (torch.compile, {shapes} distinct shapes), "
          f"later steps {later * 1e3:.1f} ms (× fused AdamW {later / med['fused']:.2f}); "
          f"states {state / n:.3f} B/param vs 8 for fp32 AdamW")


if __name__ == "__main__":
    main()
