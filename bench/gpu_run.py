"""Driver of bench/gpu.sh: measured vs planned on one GPU, through the real trainer.

Subcommands (gpu.sh calls them in this order; each is a separate process so that the trainer
runs under torchrun exactly as a user starts it):
  wheel-specs          the pinned closure of the packages the check needs beyond torch,
                       transformers and accelerate, read from THIS interpreter (the tested venv)
  missing              those packages the current interpreter lacks (stdlib only: runs before
                       anything is installed)
  prepare OUTDIR       model folder (config.json of a cut Llama-3-8B), synthetic data, one recipe
                       per activation-checkpointing mode
  collect OUTDIR       metrics.jsonl + memory.json of each run beside `shardtune plan` of the same
                       recipe -> OUTDIR/gpu_check.json, ratios printed
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import sys
from datetime import datetime, timezone
from pathlib import Path

# import name -> (distribution, minimum version from pyproject.toml). peft (LoRA only) and
# matplotlib (`shardtune report` only) are imported lazily and this check uses neither.
NEEDED = {"pydantic": ("pydantic", "2.6"), "typer": ("typer", "0.12"), "rich": ("rich", "13"),
          "yaml": ("pyyaml", "6"), "safetensors": ("safetensors", "0.4")}
PREINSTALLED = ("torch", "transformers", "accelerate")  # never from wheels: the box's own builds
PYTHONS = ("3.10", "3.11", "3.12")
# run name -> (activation checkpointing, train.loss_chunks (None = the trainer's default for the
# vocabulary: 8 here), other recipe keys): AC none / full / op price the recompute on a GPU (issue 17
# item 5); none-k1 is AC none with the full fp32 logits (loss_chunks 1, which the ranks obey since
# issue 26) beside the chunked default; none-compile (train.compile) and none-8bit (torchao's
# AdamW8bit) are the other levers (issue 26), GPU only: on the dry run's CPU their compile alone
# takes minutes (torchao's 8-bit step needs torchao on the GPU box; its run fails and says so if not).
VARIANTS = {"none": ("none", None, {}), "full": ("full", None, {}), "op": ("op", None, {}),
            "none-k1": ("none", 1, {}), "none-compile": ("none", None, {"train": {"compile": True}}),
            "none-8bit": ("none", None, {"optim": {"name": "adamw-8bit", "implementation": "auto"}})}
GPU_ONLY = ("none-compile", "none-8bit")

# GPU: Llama-3-8B widths, 8 of its 32 layers (~2.8e9 params with the untied 128,256-token
# embeddings: 45 GB of fp32 states at 16 B/param, well inside an H200). Dry run: a cut that
# keeps the vocabulary and GQA, small enough for 2 CPU cores.
SHAPES = {
    "gpu": dict(layers={"num_hidden_layers": 8}, seq_len=4096, steps=20, backend="nccl", precision="bf16-mixed"),
    # fp32 on the CPU: bf16 matmuls there took ~55 s a step at seq 256 (fp32 a few); the same
    # states (fp32 masters, grads, Adam), the same pipeline. seq 64: the test's checks (exact states,
    # the planner's activations full < op < none < k1, loss_chunks 8 vs 1: 8 tokens a chunk of the
    # 128,256-wide logits) hold at any length; 256 only cost CPU (the logits' matmuls, 4x)
    "dry-run": dict(layers={"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 896,
                            "num_attention_heads": 4, "num_key_value_heads": 1},
                    seq_len=64, steps=3, backend="gloo", precision="fp32"),
}


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


def cmd_missing(_args) -> int:
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    absent = [m for m in PREINSTALLED if importlib.util.find_spec(m) is None]
    if absent:
        print(f"gpu_run: {', '.join(absent)} must be preinstalled (never installed from wheels)", file=sys.stderr)
        return 2
    for module, (dist, minimum) in NEEDED.items():
        try:
            ok = importlib.util.find_spec(module) is not None and \
                _version_tuple(version(dist)) >= _version_tuple(minimum)
        except PackageNotFoundError:
            ok = False
        if not ok:
            print(dist)
    return 0


def _is_pure(dist) -> bool:
    wheel = dist.read_text("WHEEL") or ""
    return any(line.startswith("Tag:") and line.endswith("-none-any") for line in wheel.splitlines())


def _closure(root: str) -> list:
    """`root` and every distribution it pulls in on any of PYTHONS (markers evaluated per
    version), as installed in this interpreter."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo, seen, dists = [root], set(), []
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or name in PREINSTALLED:
            continue
        seen.add(name)
        dist = distribution(name)
        dists.append(dist)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or any(req.marker.evaluate({"python_version": v, "extra": ""}) for v in PYTHONS):
                todo.append(req.name)
    return dists


def cmd_wheel_specs(_args) -> int:
    """`pure|binary name==version`: the closure of NEEDED pinned to this interpreter's (tested)
    versions, for `pip download --no-deps`. Then `resolve-<py> spec` for each Python on which a
    pin cannot install (its Requires-Python, e.g. typer 0.29 needs 3.11): that root, relaxed to
    pyproject's minimum, for one resolving download on that version."""
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name

    printed, resolve = set(), {v: [] for v in PYTHONS}
    for dist_name, minimum in NEEDED.values():
        closure = _closure(dist_name)
        for dist in closure:
            name = canonicalize_name(dist.metadata["Name"])
            if name not in printed:
                printed.add(name)
                print(f"{'pure' if _is_pure(dist) else 'binary'} {name}=={dist.version}")
        for v in PYTHONS:
            ok = all(SpecifierSet(d.metadata["Requires-Python"] or "").contains(f"{v}.0") for d in closure)
            resolve[v].append(f"{dist_name}=={closure[0].version}" if ok else f"{dist_name}>={minimum}")
    for v, specs in resolve.items():
        if any(">=" in s for s in specs):
            print(f"resolve-{v} {' '.join(specs)}")
    return 0


def model_config(mode: str) -> dict:
    from shardtune.catalog.models import resolve_model_config

    cfg = resolve_model_config("llama-3-8b")
    cfg.update(SHAPES[mode]["layers"])
    return cfg


def synthetic_lines(num_lines: int, min_chars: int, seed: int = 0) -> list[str]:
    """Text lines longer than one row. Each row is then a single truncated example with position
    ids 0..T-1, so transformers takes sdpa's plain causal path; packed short examples would make it
    build a block-diagonal mask, a different (slower) kernel than the planner's assumption."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < min_chars:
            words.append("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))))
        lines.append(json.dumps({"text": " ".join(words)}))
    return lines


def recipe(out: Path, mode: str, variant: str) -> dict:
    shape = SHAPES[mode]
    ac, loss_chunks, extra = VARIANTS[variant]
    out_recipe = {
        "name": f"gpu-check-ac-{variant}",
        "output_dir": str(out / f"run-ac-{variant}"),
        "model": {"name": str(out / "model"), "init": "random"},
        "data": {"path": str(out / "data.jsonl"), "tokenizer": "byte", "packing": True},
        "parallel": {"strategy": "zero3", "precision": shape["precision"], "activation_checkpointing": ac},
        # foreach named: auto would be for-loop in the CPU dry run (torch's CPU default), foreach on the GPU
        "optim": {"implementation": "foreach", "lr": 1e-4, "warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0},
        "train": {"micro_batch": 1, "grad_accum": 1, "seq_len": shape["seq_len"],
                  "max_steps": shape["steps"], "seed": 0, "log_every": 1,
                  "backend": shape["backend"], "gpu": "h200-141gb", "timeout_s": 120,
                  "loss_chunks": loss_chunks},
        # a final DCP checkpoint of 2.8e9 params with Adam states would be ~34 GB of disk and
        # minutes of GPU time that measure nothing here
        "checkpoint": {"every": 0, "save_final": False, "export_hf": False, "resume": "never"},
    }
    for section, keys in extra.items():
        out_recipe[section].update(keys)
    return out_recipe


def cmd_prepare(args) -> int:
    import yaml

    out, mode = Path(args.outdir), "dry-run" if args.dry_run else "gpu"
    (out / "model").mkdir(parents=True, exist_ok=True)
    (out / "model" / "config.json").write_text(json.dumps(model_config(mode), indent=1))
    shape = SHAPES[mode]
    (out / "data.jsonl").write_text("\n".join(synthetic_lines(max(16, shape["steps"]), shape["seq_len"] + 64)) + "\n")
    variants = [v for v in VARIANTS if mode == "gpu" or v not in GPU_ONLY]
    for ac in variants:
        (out / f"recipe-ac-{ac}.yaml").write_text(yaml.safe_dump(recipe(out, mode, ac), sort_keys=False))
    (out / "mode").write_text(mode)
    (out / "variants").write_text(" ".join(variants))
    print(" ".join(variants))
    return 0


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ratio(a, b):
    """a / b to 6 significant figures (a CPU dry run's tokens/s over an H100's plan is ~1e-4: 4
    decimals would round it to 0.0)."""
    return float(f"{a / b:.6g}") if a is not None and b else None


def collect_run(out: Path, ac: str) -> dict:
    run_dir = out / f"run-ac-{ac}"
    row: dict = {"recipe": str(out / f"recipe-ac-{ac}.yaml"), "ok": False}
    try:
        plan = json.loads((out / f"plan-ac-{ac}.json").read_text())
        strat = plan["strategies"][0]
        row["activation_checkpointing"], row["loss_chunks"], row["recipe_keys"] = VARIANTS.get(ac, VARIANTS["none"])
        row["predicted"] = {"source": f"shardtune plan {row['recipe']} --gpus 1 --strategy zero3 --json",
                            "model_params": plan["model"]["params"], "memory_bytes": strat["memory"],
                            "peak_bytes": strat["memory"]["total"], "tokens_per_s": strat["tokens_per_s"],
                            "mfu": strat["mfu"], "step_time_s": strat["step_time_s"],
                            "mfu_assumed": plan["hardware"]["network"]["mfu_assumed"]}
        records = _read_jsonl(run_dir / "metrics.jsonl")
        memory = json.loads((run_dir / "memory.json").read_text())
        row["effective"] = memory.get("effective")  # what the rank ran (loss_chunks, compile, optimizer)
    except (OSError, ValueError, KeyError, IndexError) as e:
        row["error"] = f"{type(e).__name__}: {e}"
        log = out / f"train-ac-{ac}.log"
        row["log_tail"] = log.read_text()[-2000:] if log.is_file() else None
        return row
    # the first steps pay the allocator's and kernels' warm-up; the steady state is what the
    # planner predicts
    skip = max(1, len(records) // 4)
    steady = records[skip:] or records
    rank0 = memory["per_rank"][0]

    def median(key):
        vals = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    states = {k: rank0[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")}
    row["measured"] = {
        "steps": len(records), "steady_steps": [r["step"] for r in steady],
        "tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"), "step_time_s": median("step_time_s"),
        "model_tflops": median("tflops"),  # the trainer's model FLOPs (MoE: the active experts) per second
        # peak_mem_bytes is reset after every step; the max over steps is the whole run's
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records),
        "memory_method": memory["method"], "states_bytes": states,
        # the last step's max_memory_reserved (CUDA only): the allocator's cache beside the peak
        "last_step_peak_reserved_bytes": rank0.get("peak_reserved_bytes"),
        "loss_first_last": [records[0]["loss"], records[-1]["loss"]],
        "per_step": [{k: r.get(k) for k in ("step", "tokens_per_s", "mfu", "peak_mem_bytes", "step_time_s")}
                     for r in records],
    }
    p, m = row["predicted"], row["measured"]
    mem = p["memory_bytes"]
    row["ratios_measured_over_predicted"] = {
        "tokens_per_s": _ratio(m["tokens_per_s"], p["tokens_per_s"]), "mfu": _ratio(m["mfu"], p["mfu"]),
        "peak_mem": _ratio(m["peak_mem_bytes"], p["peak_bytes"]),
        "model_states": _ratio(sum(states.values()), mem["params"] + mem["grads"] + mem["optimizer"]),
    }
    # the trainer plans its own run (plan.json): the same config must give the same prediction
    run_plan = json.loads((run_dir / "plan.json").read_text())
    row["run_plan_json_peak_bytes"] = run_plan.get("strategies", [{}])[0].get("memory", {}).get("total")
    row["run_plan_json_error"] = run_plan.get("error")
    row["ok"] = True
    return row


def environment() -> dict:
    import platform

    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "host": platform.node(), "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        env.update(device=torch.cuda.get_device_name(0),
                   device_total_bytes=torch.cuda.get_device_properties(0).total_memory)
    return env


def cmd_collect(args) -> int:
    out = Path(args.outdir)
    result = {"check": "bench/gpu.sh: zero3, world 1, bf16-mixed, micro-batch 1; measured vs planned",
              "mode": (out / "mode").read_text().strip(), "environment": environment(),
              "runs": {f"ac-{ac}": collect_run(out, ac) for ac in (out / "variants").read_text().split()}}
    base = result["runs"]["ac-none"]
    if base["ok"]:  # each variant's step time over AC none's, measured and as the planner prices it
        result["step_time_vs_ac_none"] = {
            name: {"measured": _ratio(row["measured"]["step_time_s"], base["measured"]["step_time_s"]),
                   "predicted": _ratio(row["predicted"]["step_time_s"], base["predicted"]["step_time_s"])}
            for name, row in result["runs"].items() if row["ok"]}
    if (out / "recipe-ac-moe.yaml").is_file():  # the MoE row (bench/gpu_moe.py): the trainer's run, the experts
        layer = out / "moe_layer.json"
        result["moe"] = {"trainer_grouped_mm": collect_run(out, "moe"),
                         "experts_grouped_mm_vs_eager": json.loads(layer.read_text()) if layer.is_file() else None}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(f"{'run':11} {'tok/s meas':>11} {'pred':>9} {'ratio':>6} {'MFU meas':>9} {'pred':>6} "
          f"{'peak GiB meas':>13} {'pred':>7} {'ratio':>6} {'states ratio':>12}")
    for name, row in result["runs"].items():
        if not row["ok"]:
            print(f"{name:11} FAILED: {row.get('error')}")
            continue
        m, p, r = row["measured"], row["predicted"], row["ratios_measured_over_predicted"]
        mfu = f"{m['mfu']:.3f}" if m["mfu"] is not None else "—"
        print(f"{name:11} {m['tokens_per_s']:>11,.0f} {p['tokens_per_s']:>9,.0f} {r['tokens_per_s']:>6.3f} "
              f"{mfu:>9} {p['mfu']:>6.3f} {m['peak_mem_bytes'] / 2**30:>13.2f} {p['peak_bytes'] / 2**30:>7.2f} "
              f"{r['peak_mem']:>6.3f} {r['model_states']:>12.4f}")
    for name, r in result.get("step_time_vs_ac_none", {}).items():
        print(f"{name:11} step time / ac-none: measured {r['measured']}, planner {r['predicted']}")
    moe = result.get("moe", {}).get("trainer_grouped_mm", {"ok": True})
    if "measured" in moe:
        m, p = moe["measured"], moe["predicted"]
        print(f"moe        {m['tokens_per_s']:,.0f} tokens/s (planned {p['tokens_per_s']:,.0f}), model "
              f"{m['model_tflops']} TFLOP/s, peak {m['peak_mem_bytes'] / 2**30:.2f} GiB (planned "
              f"{p['peak_bytes'] / 2**30:.2f})")
    print(f"wrote {out / 'gpu_check.json'}")
    return 0 if all(r["ok"] for r in result["runs"].values()) and moe["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("missing").set_defaults(fn=cmd_missing)
    sub.add_parser("wheel-specs").set_defaults(fn=cmd_wheel_specs)
    for name, fn in (("prepare", cmd_prepare), ("collect", cmd_collect)):
        p = sub.add_parser(name)
        p.add_argument("outdir")
        p.set_defaults(fn=fn)
        if name == "prepare":
            p.add_argument("--dry-run", action="store_true", help="the tiny CPU cut (gloo)")
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
