"""shardtune against its peers, process against process: tokens/s side by side, as ratios.

    .venv/bin/python bench/throughput.py      # shardtune zero3 + ddp, limit zero3, hf-trainer, fabric-fsdp2
    .venv/bin/python bench/throughput.py --contenders shardtune-zero3,limit-zero3,shardtune-zero2,limit-zero2
    .venv/bin/python bench/throughput.py --pairs 5 --steps 12 --json /tmp/tp.json
    .venv/bin/python bench/throughput.py --mode interleaved --contenders shardtune-zero3,limit-zero3 --steps 40

--mode interleaved (bench/interleaved.py): both sides built in the same 2 ranks, steps alternated,
each timed between barriers; the ratio is the median of per-step hand/shardtune time ratios. It
resolves ~1 % where process against process cannot (each run's tokens/s moves 1.5-2x with the
load). Pairs: shardtune-S with limit-S (S = zero2 | zero3); shardtune runs its whole loop at
the recipe's log_every (--log-every).

Every contender is its own `torch.distributed.run --standalone --nproc-per-node 2` job (gloo, CPU,
OMP_NUM_THREADS=1 for all: torchrun's default, set explicitly so that no launcher differs):
  shardtune-S   the real entry point, `-m shardtune.train RECIPE.yaml`, strategy S; tokens/s read
                from the run's metrics.jsonl (train/rank/main.py times train_step alone);
                shardtune-S+IMPL adds `optim.implementation=IMPL` (e.g. shardtune-ddp+fused)
  limit-S       bench/peer_loops.py: the bare FSDP2 loop (S = zero3 or zero2)
  hf-trainer    bench/peer_loops.py: transformers.Trainer + accelerate FSDP2, in .venv-bench
  fabric        bench/peer_loops.py: Lightning Fabric FSDPStrategy, in .venv-bench (GPU only: fails)
  fabric-fsdp2  bench/peer_loops.py: Lightning Fabric ModelParallelStrategy (FSDP2), in .venv-bench
Same model (a Llama from a config, --layers × --hidden, seeded), same batches (shardtune's loader
over the generated dataset, packed, byte tokenizer), micro-batch, seq_len, fp32, AdamW, clip 1.0.

Two throughputs per run, over the same steps (the first --warmup excluded; shardtune measures
its 3rd step under torch's memory tracker, so warm-up must be >= 3):
  step  tokens per step × timed steps / Σ step_time_s, each contender's own in-step timer
  loop  the same tokens / the wall time between the arrivals of the last warm-up step's and the
        last step's metrics line, stamped by this driver polling the file every 5 ms: everything
        a step costs (data, logging, bookkeeping), measured the same way for all
A round runs every contender once, in order, and the next round in reverse (A B, B A, ...): the
2-core machine is shared and drifts, so ratios are taken within a round and the median over
rounds is reported. A contender that fails records its error's last line; the others go on.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_PY = ROOT / ".venv-bench" / "bin" / "python"


def model_config(layers: int, hidden: int) -> dict:
    """A Llama-3-shaped config (SwiGLU 8/3·h rounded, GQA 2:1, head 64) over the byte vocabulary."""
    heads = hidden // 64
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 264,
            "hidden_size": hidden, "intermediate_size": (8 * hidden // 3 + 63) // 64 * 64,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2), "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
            "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258, "initializer_range": 0.02}


def write_inputs(work: Path, args) -> dict:
    """config.json, the shardtune recipe and the peers' spec, all from the same settings."""
    (work / "model").mkdir(parents=True, exist_ok=True)
    model = work / "model" / "config.json"
    model.write_text(json.dumps(model_config(args.layers, args.hidden), indent=1))
    data = {"path": None, "generated_examples": 10000, "generated_seed": 1234, "tokenizer": "byte",
            "packing": True, "shuffle": True}
    steps = args.warmup + args.steps
    recipe = {"name": "bench", "model": {"name": str(model), "init": "random"}, "data": data,
              "parallel": {"strategy": "zero3", "precision": "fp32", "activation_checkpointing": "none"},
              "optim": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.0, "grad_clip": 1.0,
                        "warmup_steps": 0, "schedule": "cosine"},
              "train": {"micro_batch": args.micro_batch, "grad_accum": 1, "seq_len": args.seq_len,
                        "max_steps": steps, "seed": 0, "log_every": 1, "backend": "gloo"},
              "checkpoint": {"every": 0, "save_final": False, "export_hf": False, "resume": "never"}}
    import yaml

    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    spec = {"model": str(model), "data": data, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
            "seed": 0, "steps": steps, "lr": 3e-4, "mem_step": 3,
            "tokens_per_step": args.micro_batch * args.seq_len * args.nproc}
    return {"recipe": work / "recipe.yaml", "spec": spec}


PEERS = ("hf-trainer", "fabric", "fabric-fsdp2")  # bench/peer_loops.py workers run in .venv-bench, zero3


def command(name: str, inputs: dict, out: Path, nproc: int) -> list[str]:
    """argv of one contender's job; its metrics.jsonl lands in `out`."""
    kind, _, strategy = name.partition("-")
    if kind == "shardtune":  # shardtune-S or shardtune-S+IMPL (optim.implementation=IMPL)
        strategy, _, impl = strategy.partition("+")
        py = sys.executable
        tail = ["-m", "shardtune.train", str(inputs["recipe"]), "--strategy", strategy, "--output-dir", str(out),
                *([f"optim.implementation={impl}"] if impl else [])]
    else:
        if name not in PEERS and kind != "limit":
            raise SystemExit(f"unknown contender {name!r}: shardtune-S, limit-S (S = zero2 | zero3) or one of {PEERS}")
        py, which = (sys.executable, "limit") if kind == "limit" else (str(BENCH_PY), name)
        spec = dict(inputs["spec"], out=str(out), strategy=strategy if kind == "limit" else "zero3")
        (out / "spec.json").write_text(json.dumps(spec))
        tail = [str(ROOT / "bench" / "peer_loops.py"), which, str(out / "spec.json")]
    return [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *tail]


def _vm_hwm(pid: int) -> int | None:
    """Peak resident set (VmHWM) of a live process, bytes; None once it has gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def run_one(name: str, inputs: dict, work: Path, nproc: int, timeout_s: float) -> dict:
    """Run one contender to the end; its per-step lines with arrival stamps, ranks' VmHWM, files."""
    out = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    argv = command(name, inputs, out, nproc)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    log = (out / "log.txt").open("w")
    t_start = time.time()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # killing torchrun alone would leave its workers
    metrics, lines, hwm, pos, last_mem = out / "metrics.jsonl", [], {}, 0, 0.0
    while proc.poll() is None:
        now = time.time()
        if now - t_start > timeout_s:
            os.killpg(proc.pid, 9)
            break
        if metrics.exists() and metrics.stat().st_size > pos:
            with metrics.open() as f:
                f.seek(pos)
                chunk = f.read()
            done = chunk[:chunk.rfind("\n") + 1]  # a line being written waits for the next poll
            pos += len(done)
            lines += [dict(json.loads(x), arrived_s=now) for x in done.splitlines() if x.strip()]
        if now - last_mem > 0.2:  # VmHWM only grows: the last reading before exit is the peak
            for i, pid in enumerate(_children(proc.pid)):
                v = _vm_hwm(pid)
                if v is not None:
                    hwm[i] = max(hwm.get(i, 0), v)
            last_mem = now
        time.sleep(0.005)
    log.close()
    rc = proc.wait()
    result = {"name": name, "rc": rc, "wall_s": time.time() - t_start, "steps": lines,
              "vm_hwm_bytes": [hwm[i] for i in sorted(hwm)], "dir": str(out)}
    for f in ("memory.json", "plan.json"):
        if (out / f).exists():
            result[f.split(".")[0]] = json.loads((out / f).read_text())
    if rc != 0 or not lines:
        text = (out / "log.txt").read_text().strip().splitlines()
        # the workers' own exception, not torchrun's ChildFailedError that reports it
        errs = [x.strip() for x in text if re.match(r"\s*(\w+\.)*\w+(Error|Exception): ", x)
                and "ChildFailedError" not in x] or text[-1:] or ["(no output)"]
        result["error"] = errs[0][:300]
    return result


def run_interleaved(args, work: Path) -> dict:
    """--mode interleaved: one 2-rank job per shardtune-S/limit-S pair; ratios over the timed steps."""
    inputs = write_inputs(work, args)
    names = args.contenders.split(",")
    pairs = [(n, "limit-" + n.partition("-")[2]) for n in names if n.startswith("shardtune-")]
    missing = [lim for _, lim in pairs if lim not in names]
    if missing or not pairs or any("+" in n for n, _ in pairs):
        raise SystemExit("--mode interleaved takes pairs shardtune-S,limit-S (S = zero2 | zero3); "
                         f"got {args.contenders}")
    out: dict = {"ratio": {}, "load_avg": list(os.getloadavg()), "steps": {}}
    for ours, lim in pairs:
        run_dir = Path(tempfile.mkdtemp(prefix=f"{ours}-interleaved-", dir=work))
        spec = dict(inputs["spec"], out=str(run_dir), strategy=ours.partition("-")[2], recipe=str(inputs["recipe"]),
                    log_every=args.log_every)
        (run_dir / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
                str(ROOT / "bench" / "interleaved.py"), str(run_dir / "spec.json")]
        with (run_dir / "log.txt").open("w") as log:
            rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        res = run_dir / "interleaved.json"
        if rc or not res.exists():
            raise SystemExit(f"{ours} vs {lim} failed (rc {rc}); see {run_dir / 'log.txt'}")
        t = json.loads(res.read_text())
        hand, mine = t["hand_s"][args.warmup:], t["shardtune_s"][args.warmup:]
        rs = [h / o for h, o in zip(hand, mine)]
        out["ratio"][f"{ours}/{lim}"] = {"median": statistics.median(rs), "min": min(rs), "max": max(rs),
                                         "total": sum(hand) / sum(mine), "steps": len(rs)}
        out["steps"][f"{ours}/{lim}"] = t
        r = out["ratio"][f"{ours}/{lim}"]
        print(f"  {ours} / {lim}: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}; "
              f"time ratio {r['total']:.3f}) over {len(rs)} interleaved steps, log_every {args.log_every}", flush=True)
    out["load_avg_after"] = list(os.getloadavg())
    return out


def throughputs(r: dict, warmup: int, tokens_per_step: int) -> dict | None:
    """{'step', 'loop'} tokens/s over the steps after warm-up (None if the run did not get there)."""
    steps = [s for s in r["steps"] if s["step"] > warmup]
    before = [s for s in r["steps"] if s["step"] == warmup]
    if not steps or not before:
        return None
    loop_s = steps[-1]["arrived_s"] - before[0]["arrived_s"]
    return {"step": tokens_per_step * len(steps) / sum(s["step_time_s"] for s in steps),
            "loop": tokens_per_step * len(steps) / loop_s if loop_s > 0 else None}


def run_rounds(args, work: Path) -> tuple[list[dict], dict]:
    inputs = write_inputs(work, args)
    names = args.contenders.split(",")
    rounds = []
    for i in range(args.pairs):
        order = names if i % 2 == 0 else names[::-1]
        rnd = {}
        for name in order:
            r = run_one(name, inputs, work, args.nproc, args.timeout)
            r["throughput"] = throughputs(r, args.warmup, inputs["spec"]["tokens_per_step"])
            rnd[name] = r
            tp = r["throughput"]
            print(f"  round {i + 1} {name:16s} " + (f"step {tp['step']:8,.0f} loop {tp['loop'] or 0:8,.0f} tokens/s"
                  if tp else f"FAILED rc={r['rc']}: {r.get('error')}") + f"  ({r['wall_s']:.0f} s)", flush=True)
        rounds.append(rnd)
        if i == 0:  # a contender that cannot run at all will not run in the next rounds either
            names = [n for n in names if rnd[n]["throughput"]] if any(rnd[n]["throughput"] for n in names) else names
    return rounds, inputs


def ratio_table(rounds: list[dict], base: str, others: list[str]) -> list[tuple]:
    """(other, kind, median base/other over rounds, min, max, n) per comparable pair."""
    rows = []
    for other in others:
        for kind in ("step", "loop"):
            rs = [rnd[base]["throughput"][kind] / rnd[other]["throughput"][kind] for rnd in rounds
                  if other in rnd and rnd[base].get("throughput") and rnd[other].get("throughput")
                  and rnd[base]["throughput"][kind] and rnd[other]["throughput"][kind]]
            if rs:
                rows.append((other, kind, statistics.median(rs), min(rs), max(rs), len(rs)))
    return rows


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The settings every contender shares (bench/memory.py takes the same)."""
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per contender run")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("process", "interleaved"), default="process",
                    help="process: each contender its own job (default); interleaved: bench/interleaved.py")
    ap.add_argument("--log-every", type=int, default=1, help="interleaved: shardtune's train.log_every")
    ap.add_argument("--contenders", default="shardtune-zero3,limit-zero3,hf-trainer,fabric-fsdp2,shardtune-ddp")
    ap.add_argument("--pairs", type=int, default=3, help="rounds (each runs every contender once)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps after warm-up")
    ap.add_argument("--warmup", type=int, default=3)
    add_run_args(ap)
    ap.add_argument("--work", help="keep the run folders here (default: a temp dir)")
    ap.add_argument("--json", help="write every run's records here (bench/memory.py --from reads it)")
    ap.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    ap.add_argument("--from-json", help="a --json file of an earlier run: print its tables, run nothing")
    args = ap.parse_args()
    if args.from_json:
        print_tables(json.loads(Path(args.from_json).read_text())["rounds"], args)
        return
    if args.warmup < 3:
        ap.error("--warmup must be >= 3 (shardtune tracks its 3rd step's memory, which is slow)")
    work = Path(args.work or tempfile.mkdtemp(prefix="shardtune-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    import torch

    n_params = _param_count(model_config(args.layers, args.hidden))
    print(f"torch {torch.__version__}; Llama {args.layers} × {args.hidden} ({n_params / 1e6:.1f} M params), fp32, "
          f"{args.nproc} gloo ranks, micro-batch {args.micro_batch} × {args.seq_len} tokens per rank, "
          f"{args.warmup} + {args.steps} steps per run; work dir {work}", flush=True)
    if args.mode == "interleaved":
        result = run_interleaved(args, work)
        print(f"load average before {result['load_avg']}, after {result['load_avg_after']}")
        if args.json:
            Path(args.json).write_text(json.dumps(dict(result, args=vars(args), params=n_params), indent=1))
        return
    load_before = list(os.getloadavg())
    rounds, inputs = run_rounds(args, work)
    print_tables(rounds, args)
    load_after = list(os.getloadavg())
    print(f"load average before {load_before}, after {load_after}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds, "params": n_params,
                                               "load_avg": load_before, "load_avg_after": load_after}, indent=1))


def _param_count(cfg: dict) -> int:
    h, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    return L * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + 2 * v * h + h


def show(console, table, markdown: bool) -> None:
    """A rich table, or the same cells as a Markdown pipe table (for BENCHMARKS.md)."""
    if not markdown:
        console.print(table)
        return
    cols = [c.header for c in table.columns]
    cells = [list(c.cells) for c in table.columns]
    console.print(f"\n{table.title}\n\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols), soft_wrap=True)
    for row in zip(*cells):
        console.print("| " + " | ".join(row) + " |", soft_wrap=True, markup=False)


def print_tables(rounds: list[dict], args) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    names = list(rounds[0])
    t = Table(title="tokens/s per run (median over rounds; step = in-step timer, loop = wall between lines)")
    for c in ("contender", "runs ok", "step tokens/s", "loop tokens/s", "error"):
        t.add_column(c)
    for n in names:
        tps = [rnd[n]["throughput"] for rnd in rounds if n in rnd and rnd[n]["throughput"]]
        err = next((rnd[n].get("error") for rnd in rounds if n in rnd and rnd[n].get("error")), "")
        med = {k: f"{statistics.median(tp[k] for tp in tps):,.0f}" if tps else "—" for k in ("step", "loop")}
        t.add_row(n, f"{len(tps)}/{sum(n in rnd for rnd in rounds)}", med["step"], med["loop"], err or "")
    show(console, t, args.markdown)
    bases = [n for n in names if n.startswith("shardtune")]
    r = Table(title="ratios shardtune / other, within a round (median, min–max over rounds; > 1: shardtune faster)")
    for c in ("shardtune", "vs", "timer", "ratio", "range", "rounds", "target"):
        r.add_column(c)
    for base in bases:
        strategy = base.partition("-")[2].partition("+")[0]
        others = [x for x in names if not x.startswith("shardtune")]
        for other, kind, med, lo, hi, n in ratio_table(rounds, base, others):
            if other.startswith("limit") and other != f"limit-{strategy}":
                continue
            if not other.startswith("limit") and strategy not in ("zero3", "ddp"):
                continue  # the peers are asked for zero3; hf-trainer runs DDP on CPU (bench/memory.py)
            target = ">= 0.97" if other.startswith("limit") else ">= 1.0"
            r.add_row(base, other, kind, f"{med:.3f}", f"{lo:.3f}–{hi:.3f}", str(n), target)
    show(console, r, args.markdown)


if __name__ == "__main__":
    main()
