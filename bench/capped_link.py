#!/usr/bin/env python
"""Predicted vs measured step time through a bandwidth-capped link (issue 6's validation).

Two network namespaces joined by a veth pair (shardtune.testing.netns.TwoHosts) play two nodes
with one "GPU" (one CPU process) each. At each rate the link is capped with `tc tbf` on both
ends; then, through the capped link:
  1. `python -m shardtune.netbench.comm_bench` measures the collectives → a profile (scope inter);
  2. a ~3.3 M-parameter Llama trains a few steps with ddp and with zero3, built and stepped by the
     trainer's own code (train.core.model.build_model → parallel.build.build_parallel_model,
     train.core.step.train_step), fp32, gloo; each rank first times forward+backward and the AdamW
     step of an unwrapped copy (both ranks at once, so CPU sharing is included): the measured
     compute rate;
  3. the planner (plan.comm.collectives + plan.timing.predict_strategy), fed the profile and
     the compute rate, predicts each step time.
Checks: |predicted − measured| / measured ≤ 25 % at every rate and strategy, and the predicted
zero3/ddp ratio within 20 % of the measured one. Needs root (network namespaces) and iproute2.

Overlap: the planner's default (GPU) model hides each layer's collectives behind the previous
layer's compute. On CPU there is no such overlap to model: compute runs synchronously on the
thread that issues FSDP2's all-gathers (no separate stream, so the forward cannot run ahead and
prefetch), and gloo's reductions and copies need the same two cores the ranks compute on. The
bench therefore predicts with overlap off (`step_time(..., overlap=False)`); `--overlap` shows
the GPU model's numbers instead, and the table's "other s" column always shows the other one.

    .venv/bin/python bench/capped_link.py                    # 1000, 200, 50 Mbit/s
    .venv/bin/python bench/capped_link.py --rates 200 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# A few million parameters: big enough that a step moves megabytes, small enough for 2 CPU cores.
BENCH_MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 264,
    "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "hidden_act": "silu", "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258,
    "initializer_range": 0.02,
}


# ---------------------------------------------------------------- one rank (inside a namespace)
def worker(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from shardtune.config import ModelConfig, OptimConfig, ParallelConfig, RunConfig
    from shardtune.parallel.mesh import build_mesh, dp_group
    from shardtune.train.core.model import build_hf_config, build_model
    from shardtune.train.core.optim import build_optimizer, build_scheduler
    from shardtune.train.core.step import StepOptions, train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_cfg = ModelConfig(name=a.model_dir)
    par = ParallelConfig(strategy=a.strategy, precision="fp32")
    gen = torch.Generator().manual_seed(1234 + rank)

    def batch():
        ids = torch.randint(0, 256, (a.micro_batch, a.seq_len), generator=gen)
        pos = torch.arange(a.seq_len).expand(a.micro_batch, -1)
        return {"input_ids": ids, "labels": torch.roll(ids, -1, 1), "position_ids": pos}

    def agreed_max(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    # Compute rate: an unwrapped copy (no communication) runs forward+backward and the AdamW step
    # right before each training step, both ranks at once, so it sees the same CPU load as the
    # step it is compared with (this 2-core machine is shared; load drifts over a run).
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(build_hf_config(model_cfg))
    plain.config.use_cache = False
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    num_params = sum(p.numel() for p in plain.parameters())

    def probe() -> tuple[float, float]:
        mb = batch()
        dist.barrier()
        t0 = time.perf_counter()
        logits = plain(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten()).backward()
        t1 = time.perf_counter()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        return t1 - t0, time.perf_counter() - t1

    # The real thing: the trainer's build, parallelisation and step.
    mesh = build_mesh(par, world, 1, "cpu")
    model = build_model(model_cfg, par, mesh, torch.device("cpu"), seed=0)
    optim_cfg = OptimConfig()
    optimizer = build_optimizer(model, optim_cfg, par, dp_group=dp_group(mesh))
    sched = build_scheduler(optimizer, optim_cfg, a.steps + 2)
    opts = StepOptions.from_config(RunConfig(parallel=par, optim=optim_cfg), plain.config.vocab_size)
    times, fb, st, in_run = [], [], [], []
    real_step = optimizer.step

    def timed_step(*args, **kw):  # the sharded optimizer's own time, for the report only
        t = time.perf_counter()
        out = real_step(*args, **kw)
        in_run.append(time.perf_counter() - t)
        return out

    optimizer.step = timed_step
    for i in range(a.steps + 1):
        f, o = probe()
        mbs = [batch() for _ in range(a.grad_accum)]
        dist.barrier()
        t0 = time.perf_counter()
        train_step(model, optimizer, sched, mbs, opts, dp_group=dp_group(mesh), dp_size=world)
        if i:  # step 0 warms up (allocations, gloo connections)
            times.append(agreed_max(time.perf_counter() - t0))
            fb.append(agreed_max(f))
            st.append(agreed_max(o))

    def median(xs):
        return sorted(xs)[len(xs) // 2]

    step_s, compute_s, adam_s = median(times), median(fb), median(st)
    if rank == 0:
        Path(a.out).write_text(json.dumps({
            "strategy": a.strategy, "step_times_s": times, "step_time_s": step_s,
            "compute_s_per_micro_batch": compute_s, "adamw_step_s": adam_s, "num_params": num_params,
            "optimizer_step_in_run_s": median(in_run[1:])}))
    # explicit teardown: DDP on gloo can hang at exit otherwise (PYTORCH-NOTES); probe's closure
    # holds plain and plain_opt, so they are dropped by rebinding rather than `del`
    del model, optimizer
    plain = plain_opt = None
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- the driver (root namespace)
def run_pair(hosts, argv: list[str], timeout_s: float, port: int) -> None:
    """Start rank 0 in host 0 and rank 1 in host 1; a dead or hung rank fails the run."""
    import subprocess

    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR=hosts.hosts[0].addr, MASTER_PORT=str(port),
                   GLOO_SOCKET_IFNAME=hosts.hosts[rank].ifname, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO))
        procs.append(hosts.popen(rank, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    hung = [p for p in procs if p.poll() is None]
    for p in hung:
        from shardtune.testing.netns import _killpg

        _killpg(p)
    for rank, p in enumerate(procs):
        out, err = p.communicate()
        if p.returncode != 0:
            why = "timed out" if p in hung else f"exited with {p.returncode}"
            raise RuntimeError(f"rank {rank} {why}: {' | '.join(err.strip().splitlines()[-6:])}")


def predict(profile_path: str, measured: dict, strategy: str, a: argparse.Namespace, overlap: bool) -> float:
    """The planner's step time for this run, fed the profile and the measured compute rate."""
    from shardtune.layout import Layout
    from shardtune.plan import comm
    from shardtune.plan.compute import ADAMW_BYTES_PER_PARAM, model_flops_per_token
    from shardtune.plan.params import architecture_from_config, count_active_params, model_shapes
    from shardtune.plan.timing import build_cluster, predict_strategy

    arch = architecture_from_config(BENCH_MODEL)
    shapes = model_shapes(arch)
    n = sum(p.numel for p in shapes)
    assert n == measured["num_params"], (n, measured["num_params"])
    n_mm = n - arch.vocab_size * arch.hidden_size - (2 * arch.num_layers + 1) * arch.hidden_size
    flops_mb = a.micro_batch * a.seq_len * model_flops_per_token(n_mm, arch.num_layers, arch.num_heads,
                                                                 arch.head_dim, a.seq_len)
    rate = flops_mb / measured["compute_s_per_micro_batch"]  # achieved FLOP/s, used as peak × 1.0
    mem_bw = ADAMW_BYTES_PER_PARAM * n / measured["adamw_step_s"]
    cluster, _ = build_cluster(2, 1, "cpu", network_profile=profile_path)
    shard = 2 if strategy != "ddp" else 1
    colls = comm.collectives(strategy, num_params=n, trainable_params=n, world_size=2, shard_degree=shard,
                             precision="fp32", shapes=shapes)
    r = predict_strategy(arch, colls, layout=Layout.build(strategy, 2, 1), cluster=cluster,
                         micro_batch=a.micro_batch, seq_len=a.seq_len, grad_accum=a.grad_accum, ac="none",
                         ac_every=1, trainable_params=n, num_params=n, active_params=count_active_params(arch),
                         lora=False, offload="none", optimizer="adamw", peak_flops_per_s=rate, mfu=1.0,
                         mem_bw_bytes_per_s=mem_bw, overlap=overlap)
    return r["step_time_s"]


def measure_rate(rate_mbit: float, a: argparse.Namespace, tmp: Path, port0: int) -> dict:
    from shardtune.netbench.comm_bench import free_port
    from shardtune.testing.netns import TwoHosts

    row = {"rate_mbit": rate_mbit}
    with TwoHosts(rate_mbit=rate_mbit) as hosts:
        prof = tmp / f"profile_{rate_mbit:g}.json"
        run_pair(hosts, [sys.executable, "-m", "shardtune.netbench.comm_bench", "--sizes", a.sizes,
                         "--out", str(prof), "--scope", "inter", "--backend", "gloo", "--min-time", "0.2",
                         "--kinds", a.kinds],
                 a.timeout, free_port())
        links = json.loads(prof.read_text())["links"]
        row["busbw_gbps"] = {k: v["busbw_gbps"] for k, v in links.items()}
        for strategy in a.strategies:
            out = tmp / f"{strategy}_{rate_mbit:g}.json"
            run_pair(hosts, [sys.executable, str(Path(__file__).resolve()), "--worker", "--strategy", strategy,
                             "--model-dir", str(a.model_dir), "--out", str(out), "--steps", str(a.steps),
                             "--micro-batch", str(a.micro_batch), "--seq-len", str(a.seq_len),
                             "--grad-accum", str(a.grad_accum)], a.timeout, free_port())
            m = json.loads(out.read_text())
            row[strategy] = {"measured_s": m["step_time_s"],
                             "predicted_s": predict(str(prof), m, strategy, a, a.overlap),
                             "predicted_other_s": predict(str(prof), m, strategy, a, not a.overlap),
                             "compute_s_per_micro_batch": m["compute_s_per_micro_batch"],
                             "step_times_s": m["step_times_s"]}
    return row


def check(rows: list[dict], strategies: list[str], tol_step: float, tol_ratio: float) -> tuple[list[str], bool]:
    """The table's lines and whether every check passed."""
    lines = [f"{'rate':>10} | {'strategy':8} | {'measured s':>10} | {'predicted s':>11} | {'error':>7} | "
             f"{'other s':>8} | {'compute s':>8}", "-" * 84]
    ok = True
    for r in rows:
        for s in strategies:
            m, p = r[s]["measured_s"], r[s]["predicted_s"]
            err = (p - m) / m
            ok &= abs(err) <= tol_step
            lines.append(f"{r['rate_mbit']:>6g} Mb/s | {s:8} | {m:10.3f} | {p:11.3f} | {err:+7.1%} | "
                         f"{r[s]['predicted_other_s']:8.3f} | {r[s]['compute_s_per_micro_batch']:8.3f}"
                         + ("" if abs(err) <= tol_step else "  FAIL"))
        if "ddp" in strategies and "zero3" in strategies:
            mr = r["zero3"]["measured_s"] / r["ddp"]["measured_s"]
            pr = r["zero3"]["predicted_s"] / r["ddp"]["predicted_s"]
            rerr = (pr - mr) / mr
            ok &= abs(rerr) <= tol_ratio
            r["ratio"] = {"measured": mr, "predicted": pr}
            lines.append(f"{r['rate_mbit']:>6g} Mb/s | zero3/ddp | {mr:10.3f} | {pr:11.3f} | {rerr:+7.1%}"
                         + ("" if abs(rerr) <= tol_ratio else "  FAIL"))
    return lines, ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rates", default="1000,200,50", help="Link caps in Mbit/s, comma-separated.")
    ap.add_argument("--strategies", default="ddp,zero3")
    ap.add_argument("--steps", type=int, default=6, help="Timed steps (after one warm-up step).")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--sizes", default="64K,1M,4M", help="bench comm message sizes.")
    ap.add_argument("--timeout", type=float, default=300, help="Seconds per two-rank run.")
    ap.add_argument("--overlap", action="store_true",
                    help="Predict with the GPU overlap model (FSDP prefetch / DDP buckets hidden behind "
                         "compute) instead of the CPU one (none: see the module doc).")
    ap.add_argument("--tol-step", type=float, default=0.25)
    ap.add_argument("--tol-ratio", type=float, default=0.20)
    ap.add_argument("--kinds", default="all_gather,reduce_scatter,all_reduce", help="bench comm collectives.")
    ap.add_argument("--json", default=None, help="Also write the rows here.")
    a = ap.parse_args(argv)
    a.strategies = a.strategies.split(",")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker(a)

    from shardtune.testing.netns import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        print(f"capped_link: cannot run here: {reason}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="shardtune-capped-") as d:
        tmp = Path(d)
        a.model_dir = tmp / "model"
        a.model_dir.mkdir()
        (a.model_dir / "config.json").write_text(json.dumps(BENCH_MODEL))
        for rate in [float(x) for x in a.rates.split(",")]:
            t0 = time.monotonic()
            rows.append(measure_rate(rate, a, tmp, 0))
            print(f"[{rate:g} Mbit/s done in {time.monotonic() - t0:.0f} s]", file=sys.stderr, flush=True)
    lines, ok = check(rows, a.strategies, a.tol_step, a.tol_ratio)
    print(f"model: Llama {BENCH_MODEL['num_hidden_layers']} layers × {BENCH_MODEL['hidden_size']} (3.3 M params), "
          f"{a.micro_batch}×{a.seq_len} tokens per micro-batch, "
          f"grad_accum {a.grad_accum}, fp32, gloo, 2 namespaces × 1 rank; overlap={a.overlap}")
    print("\n".join(lines))
    for r in rows:
        print(f"{r['rate_mbit']:>6g} Mb/s measured busbw (GB/s): "
              + ", ".join(f"{k} {v:.4f}" for k, v in r["busbw_gbps"].items()))
    print("PASS" if ok else "FAIL: see the rows marked FAIL")
    if a.json:
        given = {k: str(v) for k, v in vars(a).items()}
        Path(a.json).write_text(json.dumps({"rows": rows, "ok": ok, "args": given}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
