"""`shardtune plan`: per-GPU memory, fit and communication of every strategy. Imports no torch.

To add options (e.g. step time, --fit): add parameters to `plan_cmd`, leave the planner inputs to
`planner_inputs`, and act on the `PlanResult` after `plan(...)` in `plan_cmd`.
"""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer


def planner_inputs(**cli: object) -> dict:
    """The CLI values that are planner inputs (`shardtune.plan.validate.Inputs`), by name."""
    from shardtune.plan.validate import Inputs

    names = set(Inputs.__dataclass_fields__)
    return {k: v for k, v in cli.items() if k in names}


def plan_cmd(
    model: Optional[str] = typer.Argument(None, help="Catalogue name (shardtune plan --list), HF config.json or model folder."),
    gpus: int = typer.Option(8, "--gpus", help="Total GPUs (world size)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", help="Nodes (default: gpus / gpus-per-node)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="GPUs per node (default min(8, gpus))."),
    gpu: str = typer.Option("h100-80gb", "--gpu", help="GPU catalogue name."),
    seq_len: int = typer.Option(2048, "--seq-len", help="Tokens per sequence."),
    micro_batch: int = typer.Option(1, "--micro-batch", help="Sequences per GPU per forward/backward."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    precision: str = typer.Option("bf16-mixed", "--precision", help="bf16-mixed | bf16 | fp32."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw | sgd | adamw-8bit."),
    ac: str = typer.Option("none", "--ac", help="Activation checkpointing: none | full | selective."),
    ac_every: int = typer.Option(2, "--ac-every", help="selective AC: checkpoint every k-th layer."),
    offload: str = typer.Option("none", "--offload", help="none | optimizer | all (CPU RAM per node is reported)."),
    lora_rank: int = typer.Option(0, "--lora-rank", help="LoRA rank on all attention and MLP projections (0: full fine-tune)."),
    accounting: str = typer.Option("shardtune", "--accounting", help="shardtune (what the trainer holds) | paper (ZeRO §5)."),
    hsdp_shard_size: Optional[int] = typer.Option(None, "--hsdp-shard-size", help="hsdp: ranks per shard group (default gpus per node)."),
    params: Optional[float] = typer.Option(None, "--params", help="A bare parameter count (e.g. 7.5e9) instead of MODEL: model states only."),
    reserve_gib: Optional[float] = typer.Option(None, "--reserve-gib", help="GiB kept free per GPU (default 1 GiB + 5 % of the GPU)."),
    strategy: Optional[list[str]] = typer.Option(None, "--strategy", help="Only these strategies (repeatable)."),
    list_models: bool = typer.Option(False, "--list", help="List the catalogue's models and GPUs, then exit."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (the plan.json format)."),
) -> None:
    """Per-GPU memory (params, grads, optimizer, activations, buffers), fit and communication of
    every strategy: ddp, zero1, zero2, zero3, hsdp."""
    if list_models:
        _print_catalogue()
        return
    from shardtune.plan import plan

    options = planner_inputs(**locals())
    options["strategies"] = strategy or None
    result = plan(**options)
    if as_json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    from shardtune.plan.report import render_text

    render_text(result)


def _print_catalogue() -> None:
    from shardtune.catalog.gpus import GPUS
    from shardtune.catalog.models import MODELS

    print("models: " + ", ".join(MODELS))
    print("gpus:   " + ", ".join(GPUS))


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)
