"""The MoE row of bench/gpu.sh: a Qwen3-MoE cut through the trainer, and its experts timed as
transformers runs them, grouped_mm against eager.

Subcommands (gpu.sh calls them; gpu_run.py `collect` folds both into gpu_check.json "moe"):
  prepare OUTDIR [--dry-run]   model-moe/config.json (Qwen3-30B-A3B's widths, 4 of its 48 layers; the
                               dry run: a tiny cut) and recipe-ac-moe.yaml (the trainer's grouped_mm)
  layer OUTDIR [--dry-run]     one Qwen3MoeSparseMoeBlock (router + experts) forward and backward over
                               seq_len tokens with `_experts_implementation` grouped_mm, then eager:
                               tokens/s and model TFLOP/s (6 · 3·h·I · k per token: the k routed
                               experts' three matmuls, forward and backward), in moe_layer.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# GPU: Qwen3-30B-A3B (hidden 2048, 128 experts of 768, top-8, vocabulary 151,936), 4 of 48 layers:
# 3.1e9 params, 50 GB of fp32 states at 16 B/param on one GPU. Dry run: a cut 2 CPU cores run in seconds.
SHAPES = {
    "gpu": dict(layers={"num_hidden_layers": 4}, seq_len=4096, steps=20, iters=10),
    "dry-run": dict(layers={"num_hidden_layers": 2, "hidden_size": 128, "moe_intermediate_size": 64,
                            "intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32},
                    seq_len=64, steps=3, iters=2),
}
IMPLEMENTATIONS = ("grouped_mm", "eager")


def model_config(mode: str) -> dict:
    from shardtune.catalog.models import resolve_model_config

    return {**resolve_model_config("qwen3-30b-a3b"), **SHAPES[mode]["layers"]}


def cmd_prepare(args) -> int:
    import yaml
    from gpu_run import recipe  # noqa: PLC0415 the dense runs' recipe, on this model

    out, mode = Path(args.outdir), "dry-run" if args.dry_run else "gpu"
    (out / "model-moe").mkdir(parents=True, exist_ok=True)
    (out / "model-moe" / "config.json").write_text(json.dumps(model_config(mode), indent=1))
    r = recipe(out, mode, "none")
    r.update(name="gpu-check-ac-moe", output_dir=str(out / "run-ac-moe"))
    r["model"]["name"] = str(out / "model-moe")
    r["train"].update(seq_len=SHAPES[mode]["seq_len"], max_steps=SHAPES[mode]["steps"])
    (out / "recipe-ac-moe.yaml").write_text(yaml.safe_dump(r, sort_keys=False))
    return 0


def _time_block(cfg: dict, impl: str, tokens: int, iters: int, device, dtype) -> dict:
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    hf._experts_implementation = impl
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(hf).to(device=device, dtype=dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, tokens, hf.hidden_size, device=device, dtype=dtype, requires_grad=True)

    def step():
        block(x).float().square().mean().backward()

    step()  # warm-up: kernels, allocator
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / iters
    flops = 6 * 3 * hf.hidden_size * hf.moe_intermediate_size * hf.num_experts_per_tok * tokens
    return {"step_s": seconds, "tokens_per_s": tokens / seconds, "model_tflops": flops / seconds / 1e12}


def cmd_layer(args) -> int:
    import torch

    out, mode = Path(args.outdir), "dry-run" if args.dry_run else "gpu"
    cuda = torch.cuda.is_available() and mode == "gpu"
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    shape, cfg = SHAPES[mode], model_config(mode)
    result = {"block": "transformers Qwen3MoeSparseMoeBlock, forward + backward", "tokens": shape["seq_len"],
              "dtype": str(dtype).removeprefix("torch."), "device": str(device), "iters": shape["iters"],
              "flops_per_token": "6 · 3 · h · I · k (the routed experts' matmuls)"}
    for impl in IMPLEMENTATIONS:
        try:
            result[impl] = _time_block(cfg, impl, shape["seq_len"], shape["iters"], device, dtype)
        except Exception as e:  # noqa: BLE001 a kernel missing on this box: recorded, the other still runs
            result[impl] = {"error": f"{type(e).__name__}: {e}"}
    g, e = result["grouped_mm"].get("tokens_per_s"), result["eager"].get("tokens_per_s")
    result["grouped_mm_over_eager"] = round(g / e, 3) if g and e else None
    (out / "moe_layer.json").write_text(json.dumps(result, indent=1))
    for impl in IMPLEMENTATIONS:
        r = result[impl]
        print(f"moe layer {impl:10} " + (f"{r['tokens_per_s']:,.0f} tokens/s, {r['model_tflops']:.2f} TFLOP/s"
                                         if "error" not in r else f"FAILED: {r['error']}"))
    return 0 if all("error" not in result[i] for i in IMPLEMENTATIONS) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, fn in (("prepare", cmd_prepare), ("layer", cmd_layer)):
        p = sub.add_parser(name)
        p.add_argument("outdir")
        p.add_argument("--dry-run", action="store_true", help="the tiny CPU cut")
        p.set_defaults(fn=fn)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
