"""`plan --fit`: the search ranks what fits, rejects what does not, and finds the hand-derived winner."""
import json
import math

import pytest

from shardtune.cli import main
from shardtune.plan.fit import search


def test_slow_link_prefers_hsdp_with_one_node_per_shard_group():
    # Llama-3-8B on 2 nodes × 8 H100 over one 10 GbE NIC per node: every step is comm-bound.
    # Bytes each node sends over its NIC per micro-batch (Ψ params, fp32 grads, bf16 gathers):
    #   zero3: (2 + 2 + 4)Ψ · 15/16 = 7.5Ψ;  ddp: 2 · 15/16 · 4Ψ = 7.5Ψ (once per step)
    #   hsdp shard s (s ≤ 8): s replica groups per node, each all-reducing 4Ψ/s over r = 16/s
    #   ranks: s · 2(r−1)/r · 4Ψ/s = 8Ψ(r−1)/r → 4Ψ (s = 8), 6Ψ (s = 4), 7Ψ (s = 2).
    # So hsdp with 8-GPU shard groups moves the fewest bytes and must win among the layouts without a
    # pipeline (pp held at 1; with pp searched a pipeline across the 2 nodes wins: tests/unit/test_pp_plan.py).
    fit = search("llama-3-8b", gpus=16, nodes=2, interconnect="eth-10g", seq_len=2048, keep=frozenset({"pp"}))
    assert fit.best is not None
    assert (fit.best.strategy, fit.best.hsdp_shard_size) == ("hsdp", 8)
    assert fit.best.fits and all(c.fits for c in fit.ranked)
    speeds = [c.tokens_per_s for c in fit.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert all(c.why for c in fit.ranked[1:])


def test_what_does_not_fit_is_rejected_with_a_reason():
    # 70B with AdamW on 8 × 80 GB: ddp holds 16 B/param = 1.1 TB per GPU, it can never fit.
    fit = search("llama-3-70b", gpus=8, seq_len=2048, strategies=["ddp", "zero3"])
    assert all(c.strategy == "zero3" for c in fit.ranked)
    ddp = [c for c in fit.rejected if c.strategy == "ddp"]
    assert ddp and all(not c.fits and "GiB usable" in c.why for c in ddp)
    # at least the model states of the leanest precision (pure bf16: 2 + 2 + 4 B/param, unsharded)
    assert min(c.peak_gib for c in ddp) > 70e9 * 8 / 2**30


def test_fit_cli_json(capsys):
    rc = main(["plan", "tiny-llama", "--gpus", "2", "--fit", "--json", "--seq-len", "128"])
    assert rc in (0, None)
    out = json.loads(capsys.readouterr().out)
    assert out["best"]["fits"] and out["searched"] > 10
    assert out["best"]["flags"].startswith("--strategy ")


def test_plan_json_has_timing_fields(capsys):
    rc = main(["plan", "llama-3-8b", "--gpus", "16", "--nodes", "2", "--interconnect", "eth-10g",
               "--tokens", "1e9", "--json", "--strategy", "ddp"])
    assert rc in (0, None)
    s = json.loads(capsys.readouterr().out)["strategies"][0]
    for key in ("step_time_s", "tokens_per_s", "mfu", "comm_time_s", "compute_time_s", "gpu_hours"):
        assert s[key] > 0
    # ddp: one fp32 all-reduce of the grads per step across 2 nodes over one 10 GbE NIC each:
    # 2·15/16·(4 B × params) / (0.9 × 1.25e9 B/s) (catalogue: 90 % of line rate), plus, for each
    # of DDP's 25 MiB buckets, 2(n−1) = 30 ring steps of α = 50 µs.
    n = sum(c["payload_bytes"] for c in s["collectives"])  # the one all-reduce buffer, 4 B × params
    buckets = math.ceil(n / (25 * 2**20))
    assert s["comm_time_s"] == pytest.approx(2 * 15 / 16 * n / 1.125e9 + buckets * 30 * 50e-6, rel=1e-3)


@pytest.mark.parametrize("args", [["--interconnect", "eth-11g"], ["--mfu", "1.5"], ["--intra-node", "eth-10g"],
                                  ["--network-profile", "/nonexistent.json"]])
def test_bad_timing_options_are_user_errors(args, capsys):
    assert main(["plan", "tiny-llama", "--gpus", "2", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardtune: error:") and len(err.strip().splitlines()) == 1


def _parse_as_cli(argv: list[str]) -> dict:
    """The params click parses from `argv` (after `shardtune`) for the real subcommand: no run starts."""
    import typer

    from shardtune.cli import app

    group = typer.main.get_command(app)
    ctx = group.make_context("shardtune", list(argv[1:]))
    names = list(argv[1:])
    cmd = group
    while hasattr(cmd, "commands"):  # walk `launch slurm` down to its leaf command
        name, cmd, names = *cmd.resolve_command(ctx, names)[:2], names[1:]
        ctx = cmd.make_context(name, names, parent=ctx)
    return ctx.params


@pytest.mark.parametrize("argv", [
    ["llama-3-8b", "--gpus", "8"],  # picks pure bf16: must carry optim.implementation=bf16-stochastic
    ["llama-3-70b", "--gpus", "16", "--nodes", "2", "--lora-rank", "16"],  # two nodes: launch slurm
    ["recipes/tiny-cpu.yaml", "--gpus", "2", "--gpu", "a100-40gb"],  # the recipe planned is the one run
    ["llama-3-8b", "--gpus", "16", "--nodes", "2", "--interconnect", "eth-10g", "--strategy", "hsdp", "--pp", "1"],
    ["llama-3-8b", "--gpus", "8", "--seq-len", "131072", "--ac", "full"],  # long: cp, grad_accum follows it
    ["llama-3.1-405b", "--gpus", "64", "--nodes", "8", "--interconnect", "eth-100g"],  # pp 8, an uneven split
    # QLoRA: the search plans the nf4 base (it planned it in bf16: offload all), and the line keeps it
    ["llama-3-8b", "--gpus", "1", "--gpu", "rtx4090-24gb", "--lora-rank", "16", "--quantize-base", "nf4"],
    # inputs the search keeps reach the line too: adapter targets, the objective
    ["llama-3-8b", "--gpus", "2", "--lora-rank", "8", "--lora-target-modules", "q_proj", "--lora-target-modules",
     "v_proj", "--objective", "dpo"],
])
def test_fit_pick_pastes_into_the_trainer_as_printed(argv, capsys):
    import shlex

    from shardtune.config import load_recipe
    from shardtune.train.launcher.supervise import resolve_config

    assert main(["plan", *argv, "--fit", "--json"]) in (0, None)
    out = json.loads(capsys.readouterr().out)
    best, line = out["best"], out["train_command"]
    if line is None:  # a pipeline the trainer does not run yet (cp, offload, ...): no command, a note says why
        assert best["pp"] > 1, best
        assert any(n.startswith("planned only, no train command: parallel.pp ") for n in out["notes"]), out["notes"]
        return
    args = shlex.split(line)
    params = _parse_as_cli(args)
    if args[1] == "train":
        from shardtune.config.flags import FLAG_BY_NAME

        flags = {k: v for k, v in params.items() if k in FLAG_BY_NAME}  # the recipe-key flags
        cfg = resolve_config(params["recipe"], params["overrides"], **flags)
        assert params["nproc"] == int(argv[argv.index("--gpus") + 1])
    else:
        cfg = load_recipe(params["recipe"], params["overrides"])
        assert params["nodes"] * params["gpus_per_node"] == int(argv[argv.index("--gpus") + 1])
    got = cfg.plan_inputs()
    assert (cfg.parallel.strategy, got["precision"], got["ac"], got["offload"], got["micro_batch"]) == (
        best["strategy"], best["precision"], best["ac"], best["offload"], best["micro_batch"]), line
    assert got["optimizer_impl"] == best["optimizer_impl"]
    if best["precision"] == "bf16":  # pure bf16 under torch AdamW needs the stochastic-rounding step
        assert got["optimizer_impl"] == "bf16-stochastic"
    if best["strategy"] == "hsdp":
        assert got["hsdp_shard_size"] == best["hsdp_shard_size"]
    assert got["seq_len"] == (128 if "tiny" in argv[0] else 131072 if "--seq-len" in argv else 2048)
    assert (got["cp"], got["activation_offload"], got["grad_accum"]) == (
        best["cp"], best["activation_offload"], best["grad_accum"]), line
    assert (got["pp"], got["pp_layers"], got["tp"]) == (best["pp"], best["pp_layers"], best["tp"]), line
    if "eth-100g" in argv:
        assert best["pp"] == 8 and sum(best["pp_layers"]) == 126
    if "--lora-rank" in argv:
        assert got["lora_rank"] == int(argv[argv.index("--lora-rank") + 1])
    assert got["quantize_base"] == ("nf4" if "--quantize-base" in argv else "none"), line
    if "--lora-target-modules" in argv:
        assert (got["lora_target_modules"], got["objective"]) == (["q_proj", "v_proj"], "dpo"), line
    if "--gpu" in argv:
        assert got["gpu"] == argv[argv.index("--gpu") + 1]


def test_fit_never_picks_what_the_trainer_refuses():
    from shardtune.rules.combination import check_combination

    fit = search("llama-3-8b", gpus=8, optimizer="adamw-8bit")
    assert fit.best and fit.ranked
    for c in fit.ranked:  # every candidate passes the rule `shardtune train` applies
        check_combination(c.strategy, precision=c.precision, offload=c.offload, optimizer=c.optimizer,
                          optimizer_impl=c.optimizer_impl, hsdp_shard_size=c.hsdp_shard_size,
                          activation_checkpointing=c.ac)


def test_fit_keeps_an_offload_asked_for_and_refuses_it_with_ddp_as_plan_does(capsys):
    # issue 18 item 1: --offload all --strategy ddp is one line, exit 2, in plan and plan --fit alike
    # (offload all is FSDP2's CPUOffloadPolicy; DDP has none)
    argv = ["plan", "llama-3-8b", "--offload", "all", "--strategy", "ddp"]
    assert main(argv) == 2
    plan_err = capsys.readouterr().err
    assert main([*argv, "--fit"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == plan_err and len(err.strip().splitlines()) == 1 and "offload 'all'" in err
    # without --strategy, every candidate keeps offload all (none is not searched instead)
    fit = search("llama-3-8b", gpus=8, offload="all")
    assert fit.ranked and all(c.offload == "all" for c in fit.ranked + fit.rejected)
    assert any("offload all kept" in n for n in fit.notes)
    # a planner-only offload is not what the trainer runs: the search stays on none and all
    fit = search("llama-3-8b", gpus=8, offload="optimizer")
    assert {c.offload for c in fit.ranked + fit.rejected} <= {"none", "all"}


@pytest.mark.parametrize("kw", [dict(model="llama-3-8b", gpus=8), dict(model="llama-3-8b", gpus=8, micro_batch=2,
                                                                      grad_accum=4),
                                dict(model="llama-3-70b", gpus=16, nodes=2, seq_len=4096, grad_accum=8)])
def test_fit_keeps_the_global_batch_and_sequence_unless_asked(kw):
    """Every candidate of a plain --fit trains micro × accum × (gpus / tp) = the plan's own sequences
    per step at its seq_len; --fit-batch searches the micro-batch and says what it changes."""
    fit = search(**kw)
    want = kw.get("micro_batch", 1) * kw.get("grad_accum", 1) * kw["gpus"]
    assert fit.ranked and fit.base["global_batch"] == want and fit.base["seq_len"] == kw.get("seq_len", 2048)
    for c in fit.ranked + fit.rejected:
        # a pipeline (pp across the nodes) has pp times fewer data-parallel ranks: more micro-batches a step
        assert c.micro_batch * c.grad_accum * (kw["gpus"] // (c.tp * c.pp)) == want, c.label()
        assert c.pp > 1 or c.grad_accum == kw.get("grad_accum", 1), c.label()
        assert "(was" not in c.changes(fit.base)["global batch"]
    wide = search(**kw, fit_batch=True)
    assert {c.micro_batch for c in wide.ranked + wide.rejected} - {kw.get("micro_batch", 1)}
    moved = [c for c in wide.ranked if c.global_batch != want]
    assert all(f"(was {want})" in c.changes(wide.base)["global batch"] for c in moved)


def test_fit_table_names_what_each_candidate_changes(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the piped default, whatever the test process's own console is
    assert main(["plan", "llama-3-8b", "--gpus", "8", "--fit"]) in (0, None)
    out = capsys.readouterr().out
    assert "numerics" in out and "global batch" in out and "2048 (kept)" in out
    fit = search("llama-3-8b", gpus=8)
    if fit.best.precision != "bf16-mixed":  # the plan's own numerics: a switch is said, never quiet
        assert f"changes: numerics {fit.best.precision} (was bf16-mixed)" in out


@pytest.mark.parametrize("recipe", ["tiny-cpu", "llama-3-8b-8xh100", "llama-3-70b-qlora-2x4090"])
def test_plan_recipe_marks_the_recipes_own_strategy_row(recipe, capsys):
    import yaml

    path = f"recipes/{recipe}.yaml"
    want = yaml.safe_load(open(path))["parallel"]["strategy"]
    assert main(["plan", path, "--gpus", "2", "--wide"]) in (0, None)
    out = capsys.readouterr().out
    starred = [line.split()[0] for line in out.splitlines() if line.strip().split()[1:2] == ["*"]]
    assert starred == [want] and f"* the recipe's strategy (parallel.strategy {want})" in out


@pytest.mark.parametrize("argv", [
    ["llama-3-8b", "--gpus", "1", "--gpu", "rtx4090-24gb", "--lora-rank", "16", "--quantize-base", "nf4"],
    ["llama-3-8b", "--gpus", "2", "--lora-rank", "8", "--lora-target-modules", "q_proj"],
    ["llama-3-8b", "--gpus", "8"],
])
def test_fit_best_is_what_plan_says_for_that_configuration(argv, capsys):
    """`plan --fit`'s pick, planned again by plain `plan` with the pick's options: the same peak (the
    search once planned a QLoRA base unquantised: ddp's 19.5 GiB with nf4 was 29.2 to it, so it
    picked zero3 with offload all)."""
    assert main(["plan", *argv, "--fit", "--json"]) in (0, None)
    best = json.loads(capsys.readouterr().out)["best"]
    assert main(["plan", *argv, *best["flags"].split(), "--json"]) in (0, None)
    (row,) = json.loads(capsys.readouterr().out)["strategies"]
    assert row["memory"]["total"] / 2**30 == pytest.approx(best["peak_gib"], rel=1e-9), (row, best)
