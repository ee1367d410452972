"""`shardtune plan`: per-GPU memory, fit and communication of every strategy. Imports no torch.

To add a planner input: add the field to `plan.validate.PlanInputs` (its default is the option's)
and a parameter of the same name to `plan_cmd`; a recipe key that sets it goes in
config/plan_keys.py (tests/unit/test_key_table.py checks all three agree).
"""
from __future__ import annotations

import json
import sys

import typer

from shardtune.plan.validate import PlanInputs


def recipe_inputs(path: str, given: set[str]) -> dict:
    """Planner inputs taken from a training recipe (YAML), except those given on the command line:
    `shardtune plan recipes/tiny-cpu.yaml --gpus 8` plans exactly what `shardtune train` would run."""
    from shardtune.config import load_recipe

    cfg = load_recipe(path)
    if cfg.model.plan_name() != cfg.model.name:
        print(f"note: model folder {cfg.model.name!r} is not on this machine; planned as its architecture "
              f"{cfg.model.architecture!r}", file=sys.stderr)
    return {k: v for k, v in cfg.plan_inputs().items() if k not in given}


def _given_on_command_line(ctx: typer.Context) -> set[str]:
    return {name for name in ctx.params
            if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"}


_D = PlanInputs()  # the defaults, in one place
_RENAMED = {"host_ram": "host_ram_gib", "strategy": "strategies"}  # option name → PlanInputs field


def plan_input_values(params: dict) -> dict:
    """The PlanInputs fields among a command's parameters (each option is named as its field)."""
    fields = set(PlanInputs.__dataclass_fields__)
    values = {_RENAMED.get(k, k): v for k, v in params.items() if _RENAMED.get(k, k) in fields}
    values["strategies"] = values.get("strategies") or None
    return values


def plan_cmd(
    ctx: typer.Context,
    model: str | None = typer.Argument(
        None, metavar="MODEL",
        help="Catalogue name (shardtune plan --list), HF config.json, model folder, or a training recipe "
        "(YAML: its model and settings)."),
    gpus: int = typer.Option(_D.gpus, "--gpus", metavar="N", help="Total GPUs (world size)."),
    nodes: int | None = typer.Option(_D.nodes, "--nodes", metavar="N", help="Nodes (default: gpus / gpus-per-node)."),
    gpus_per_node: int | None = typer.Option(_D.gpus_per_node, "--gpus-per-node", metavar="N",
                                             help="GPUs per node (default min(8, gpus))."),
    gpu: str = typer.Option(_D.gpu, "--gpu", metavar="NAME", help="GPU catalogue name."),
    seq_len: int = typer.Option(_D.seq_len, "--seq-len", metavar="TOKENS", help="Tokens per sequence."),
    micro_batch: int = typer.Option(_D.micro_batch, "--micro-batch", metavar="N",
        help="Sequences per GPU per forward/backward."),
    grad_accum: int = typer.Option(_D.grad_accum, "--grad-accum", metavar="N",
        help="Micro-batches per optimizer step."),
    precision: str = typer.Option(_D.precision, "--precision", metavar="[bf16-mixed|bf16|fp32]",
        help="bf16-mixed | bf16 | fp32."),
    optimizer: str = typer.Option(_D.optimizer, "--optimizer", metavar="[adamw|sgd|adamw-8bit]",
        help="adamw | sgd | adamw-8bit."),
    optimizer_impl: str = typer.Option(
        _D.optimizer_impl, "--optimizer-impl", metavar="[auto|foreach|fused|for-loop|bf16-stochastic]",
        help="AdamW kernel: auto (torch's choice: foreach on GPUs, for-loop with --offload all) | foreach | fused "
        "| for-loop | bf16-stochastic; sets the step's temporaries."),
    ac: str = typer.Option(_D.ac, "--ac", metavar="[none|full|op|layer]",
        help="Activation checkpointing: none | full | op (matmul outputs kept) | layer (every k-th; "
             "old name selective)."),
    ac_every: int = typer.Option(_D.ac_every, "--ac-every", metavar="K",
        help="layer AC: checkpoint every k-th layer."),
    offload: str = typer.Option(_D.offload, "--offload", metavar="[none|optimizer|all]",
        help="none | optimizer | all (CPU RAM per node is reported)."),
    lora_rank: int = typer.Option(_D.lora_rank, "--lora-rank", metavar="R",
                                  help="LoRA rank on all attention and MLP projections (0: full fine-tune)."),
    quantize_base: str = typer.Option(_D.quantize_base, "--quantize-base", metavar="[none|nf4]",
                                      help="nf4: the LoRA base in 4-bit NF4 (QLoRA; needs --lora-rank)."),
    loss_chunks: int | None = typer.Option(
        _D.loss_chunks, "--loss-chunks", metavar="K",
        help="Cross-entropy over K token chunks (train.loss_chunks; default 8 above a 32k vocabulary, else 1)."),
    objective: str = typer.Option(_D.objective, "--objective", metavar="[sft|dpo]",
                                  help="dpo: preference tuning; adds the reference model (memory.reference) and "
                                       "its forward (train.objective)."),
    reference: str = typer.Option(_D.reference, "--reference", metavar="[live|precompute]",
                                  help="dpo's reference log-probs: live (a sharded frozen copy; LoRA: the base) or "
                                       "precompute (computed once, no copy held)."),
    accounting: str = typer.Option(_D.accounting, "--accounting", metavar="[shardtune|paper]",
                                   help="shardtune (what the trainer holds) | paper (ZeRO §5)."),
    hsdp_shard_size: int | None = typer.Option(_D.hsdp_shard_size, "--hsdp-shard-size", metavar="N",
                                               help="hsdp: ranks per shard group (default data-parallel ranks "
                                                    "per node: gpus per node / tp)."),
    tp: int = typer.Option(_D.tp, "--tp", metavar="N",
                           help="Tensor-parallel degree inside a node (parallel.tp); FSDP shards over gpus / tp."),
    sequence_parallel: bool | None = typer.Option(
        _D.sequence_parallel, "--sequence-parallel/--no-sequence-parallel",
        help="Sequence parallelism with --tp (parallel.sequence_parallel; default on when tp > 1)."),
    tp_across_nodes: bool = typer.Option(
        _D.tp_across_nodes, "--tp-across-nodes",
        help="Allow a --tp larger than a node (parallel.tp_across_nodes): TP priced on the inter-node link."),
    cp: int = typer.Option(_D.cp, "--cp", metavar="N",
                           help="Context-parallel degree (parallel.cp): each row's sequence split over N ranks "
                                "(all-to-all, DeepSpeed-Ulysses); FSDP shards over dp × cp."),
    activation_offload: bool = typer.Option(
        _D.activation_offload, "--activation-offload",
        help="Saved activations (with --ac full: the layer inputs) in pinned host RAM (parallel.activation_offload); "
             "host RAM per node and PCIe time are reported."),
    host_ram: float | None = typer.Option(_D.host_ram_gib, "--host-ram", metavar="GIB",
                                          help="Host RAM per node for --activation-offload (default 256 GiB per GPU)."),
    params: float | None = typer.Option(_D.params, "--params", metavar="COUNT",
                                        help="A bare parameter count (e.g. 7.5e9) instead of MODEL: model states "
                                             "only."),
    reserve_gib: float | None = typer.Option(_D.reserve_gib, "--reserve-gib", metavar="GIB",
                                             help="GiB kept free per GPU (default 1 GiB + 5 % of the GPU)."),
    strategy: list[str] | None = typer.Option(None, "--strategy", metavar="[ddp|zero1|zero2|zero3|hsdp]",
        help="Only these strategies (repeatable)."),
    list_models: bool = typer.Option(False, "--list", help="List the catalogue's models and GPUs, then exit."),
    wide: bool = typer.Option(False, "--wide", help="Every table column, whatever the terminal's width (default: "
                              "compact tables below 112 columns; COLUMNS is honoured, piped too)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (the plan.json format)."),
    simulate: bool = typer.Option(
        False, "--simulate", help="Also trace the trainer's real step on fake tensors at world size --gpus "
        "(needs torch) and show it beside the analytic numbers."),
    interconnect: str | None = typer.Option(
        _D.interconnect, "--interconnect", metavar="NAME",
        help="Link between nodes: ib-ndr-400, ib-hdr-200, roce-400, efa, "
        "eth-100g, eth-25g, eth-10g (default ib-ndr-400)."),
    intra_node: str | None = typer.Option(
        _D.intra_node, "--intra-node", metavar="NAME",
        help="Link inside a node: nvlink-h100, nvlink-a100, pcie-gen4, pcie-gen5 (default from --gpu)."),
    nics_per_node: int | None = typer.Option(
        _D.nics_per_node, "--nics-per-node", metavar="N",
        help="NICs per node for --interconnect (default: the catalogue's, e.g. 8 for IB, 1 for Ethernet)."),
    network_profile: str | None = typer.Option(
        _D.network_profile, "--network-profile", metavar="FILE",
        help="Measured profile from `shardtune bench comm -o FILE`, used instead of catalogue bandwidths."),
    mfu: float | None = typer.Option(_D.mfu, "--mfu", metavar="FRACTION",
                                     help="Achievable MFU of the compute (default per GPU, e.g. 0.40 for H100)."),
    tokens: float | None = typer.Option(_D.tokens, "--tokens", metavar="COUNT",
                                        help="Tokens to train on: report wall-clock days and GPU-hours."),
    fit: bool = typer.Option(
        False, "--fit", help="Search strategy × tp × AC × offload × micro-batch × shard size × precision for the "
        "fastest config that fits (a given --strategy, --tp or --offload is kept; the global batch and sequence "
        "are kept)."),
    fit_batch: bool = typer.Option(False, "--fit-batch", help="With --fit: also search the micro-batch (the global "
                                   "batch then changes; each candidate says so)."),
) -> None:
    """Per-GPU memory (params, grads, optimizer, activations, buffers), fit and communication of
    every strategy: ddp, zero1, zero2, zero3, hsdp (with --tp: beside tensor parallelism)."""
    if list_models:
        _print_catalogue()
        return
    from shardtune.plan import plan

    values = plan_input_values(ctx.params)
    if model and model.endswith((".yaml", ".yml")):
        values.update(recipe_inputs(model, _given_on_command_line(ctx) - {"model"}))
    inputs = PlanInputs(**values)
    if fit or fit_batch:
        _fit(inputs, as_json, model if model and model.endswith((".yaml", ".yml")) else None, fit_batch)
        return
    result = plan(inputs)
    if simulate and not _untraced(result):  # torch is imported only here (verify/simulate.py)
        from shardtune.verify.simulate import attach_simulation

        attach_simulation(result, inputs.model)
    if as_json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    from shardtune.plan.report import render_text

    mark = None
    if model and model.endswith((".yaml", ".yml")):
        from shardtune.config import load_recipe

        mark = load_recipe(model).parallel.strategy  # its row is marked: the strategy the recipe runs
    render_text(result, wide=wide, mark=mark)
    if simulate:
        from shardtune.verify.compare import render_simulated

        render_simulated(result)


def _untraced(result) -> bool:
    """--simulate with cp > 1 or activation offload: the trace (verify/simulate.py) runs neither, so
    each strategy is marked untraced with the reason (never traced as cp 1)."""
    inp = result.inputs
    reason = ("the fake-tensor trace does not run context parallelism (cp > 1)" if inp.get("cp", 1) > 1 else
              "the fake-tensor trace does not run activation offload" if inp.get("activation_offload") else "")
    if not reason:
        return False
    for sp in result.strategies:
        sp.simulated = {"status": "analytic fallback", "reason": reason}
    print(f"shardtune: --simulate cannot trace {', '.join(s.name for s in result.strategies)}: {reason}; "
          "showing the analytic plan (marked 'analytic')", file=sys.stderr)
    return True


def _fit(inputs: PlanInputs, as_json: bool, recipe: str | None, fit_batch: bool = False) -> None:
    from shardtune.plan.fit import render_fit, search
    from shardtune.plan.fit_commands import train_line
    from shardtune.plan.validate import resolve_inputs

    result = search(inputs, fit_batch=fit_batch)
    use = train_line(result.best, resolve_inputs(inputs), recipe) if result.best else None
    if as_json:
        json.dump(dict(result.to_dict(), train_command=use), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    from shardtune.plan.report import make_console

    render_fit(result, make_console(), use)


def _print_catalogue() -> None:
    from shardtune.catalog.gpus import GPUS
    from shardtune.catalog.models import MODELS

    print("models: " + ", ".join(MODELS))
    print("gpus:   " + ", ".join(GPUS))


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)
