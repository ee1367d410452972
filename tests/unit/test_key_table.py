"""One key table (config/plan_keys.py): a planner input added in one place appears in all —
the recipe schema, PlanInputs, `shardtune plan`'s options, RunConfig.plan_inputs and the trainer's
flags."""
from __future__ import annotations

import dataclasses

import typer

from shardtune.config import RunConfig, load_recipe
from shardtune.config.flags import TRAIN_FLAGS
from shardtune.config.keys import all_keys
from shardtune.config.plan_keys import PLAN_KEYS, PLANNER_ONLY
from shardtune.plan.commands import _RENAMED, plan_cmd, plan_input_values
from shardtune.plan.validate import PlanInputs

FIELDS = {f.name for f in dataclasses.fields(PlanInputs)}


def test_every_planner_input_is_a_recipe_key_or_planner_only():
    assert set(PLAN_KEYS) <= FIELDS, set(PLAN_KEYS) - FIELDS
    assert not set(PLAN_KEYS) & PLANNER_ONLY
    assert FIELDS == set(PLAN_KEYS) | PLANNER_ONLY, FIELDS ^ (set(PLAN_KEYS) | PLANNER_ONLY)
    keys = set(all_keys(RunConfig))
    assert set(PLAN_KEYS.values()) <= keys, set(PLAN_KEYS.values()) - keys


def test_plan_has_an_option_for_every_input_and_passes_each_through():
    options = {p.name for p in typer.main.get_command(_app()).params}
    named = {_RENAMED.get(o, o) for o in options}
    assert FIELDS <= named, f"PlanInputs fields without a `shardtune plan` option: {FIELDS - named}"
    # each option reaches PlanInputs under its field's name, with the value given
    given = {o: f"v-{o}" for o in options}
    values = plan_input_values(given)
    assert set(values) == FIELDS
    assert all(values[_RENAMED.get(o, o)] == f"v-{o}" for o in options if _RENAMED.get(o, o) in FIELDS)


SETTINGS = (  # every table key off its default, over three recipes (the rules refuse some combinations)
    {"train.gpu": "a100-80gb", "train.seq_len": 4096, "train.micro_batch": 3, "train.grad_accum": 5,
     "parallel.precision": "fp32", "optim.implementation": "foreach", "parallel.activation_checkpointing": "layer",
     "parallel.ac_every": 3, "parallel.strategy": "hsdp", "parallel.hsdp_shard_size": 2, "lora.rank": 8,
     "train.loss_chunks": 4, "parallel.offload": "all"},
    {"parallel.tp": 2, "parallel.sequence_parallel": False, "parallel.tp_across_nodes": True, "parallel.cp": 2,
     "parallel.activation_offload": True},
    {"optim.name": "adamw-8bit", "train.objective": "dpo", "train.reference": "precompute", "lora.rank": 4,
     "lora.quantize_base": "nf4"},
    {"parallel.ep": 2, "checkpoint.save_final": False},  # ep saves no checkpoint yet (rules/ep.py)
    {"lora.rank": 8, "lora.dropout": 0.0, "lora.target_parameters": ["experts.gate_up_proj"],
     "lora.target_modules": ["q_proj", "v_proj"]},
    {"train.objective": "grpo", "rl.num_generations": 4, "rl.max_new_tokens": 32, "rl.beta": 0.04,
     "rl.reward": "[{name: length, target: 4}]"},
    {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b", "parallel.pp_virtual_stages": 2,
     "parallel.pp_layers": [8, 8, 8, 8], "train.grad_accum": 2},
)


def test_plan_inputs_read_each_key_of_the_table():
    by_key = {key: field for field, key in PLAN_KEYS.items()}
    seen = set()
    for overrides in SETTINGS:
        try:
            cfg = load_recipe(None, ["model.name=llama-3-8b", *(f"{k}={v}" for k, v in overrides.items())])
        except Exception as e:  # a combination the rules refuse would make this test pass nothing
            raise AssertionError(f"{overrides}: {e}") from e
        got = cfg.plan_inputs()
        assert set(got) == set(PLAN_KEYS) and got["model"] == "llama-3-8b"
        for key, value in overrides.items():
            if key in by_key:
                assert got[by_key[key]] == value, key
                seen.add(key)
    assert seen == set(PLAN_KEYS.values()) - {"model.name"}, set(PLAN_KEYS.values()) - seen


def test_each_train_flag_names_a_recipe_key():
    keys = set(all_keys(RunConfig))
    assert all(f.key in keys for f in TRAIN_FLAGS), [f.key for f in TRAIN_FLAGS if f.key not in keys]


def _app():
    app = typer.Typer()
    app.command()(plan_cmd)
    return app


# --- the simulator's inputs (verify/trace_inputs.py): every PLAN_KEYS field traced or declared not traced

# each traced field off its default where it can be (optimizer: adamw is the one the trace runs), in
# inputs the planner and the trainer's config accept (tp refuses loss chunks: two samples);
# hsdp_shard_size reaches parallel.hsdp_shard_size under hsdp
TRACED_SAMPLES = (
    {"model": "llama-3-8b", "gpus": 8, "gpu": "a100-80gb", "seq_len": 4096, "micro_batch": 3, "grad_accum": 5,
     "precision": "fp32", "optimizer": "adamw", "optimizer_impl": "foreach", "ac": "layer", "ac_every": 3,
     "hsdp_shard_size": 2, "loss_chunks": 4, "objective": "dpo", "reference": "precompute"},
    {"model": "llama-3-8b", "gpus": 8, "hsdp_shard_size": 2, "tp": 2, "sequence_parallel": False,
     "tp_across_nodes": True, "objective": "simpo"},
)
# each untraced field off its default, with what it acts under (pp > 1, lora_rank > 0, grpo)
UNTRACED_SAMPLES = {
    "offload": {"offload": "optimizer"},
    "lora_rank": {"lora_rank": 8},
    "quantize_base": {"lora_rank": 8, "quantize_base": "nf4"},
    "lora_target_parameters": {"lora_rank": 8, "lora_target_parameters": ["experts.gate_up_proj"]},
    "lora_target_modules": {"lora_rank": 8, "lora_target_modules": ["q_proj"]},
    "num_generations": {"objective": "grpo", "num_generations": 4},
    "max_new_tokens": {"objective": "grpo", "max_new_tokens": 32},
    "rl_beta": {"objective": "grpo", "rl_beta": 0.04},
    "cp": {"cp": 2},
    "activation_offload": {"activation_offload": True},
    "ep": {"ep": 2},
    "pp": {"pp": 2, "grad_accum": 2},
    "pp_schedule": {"pp": 2, "grad_accum": 2, "pp_schedule": "gpipe"},
    "pp_virtual_stages": {"pp": 2, "grad_accum": 4, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2},
    "pp_layers": {"pp": 2, "grad_accum": 2, "pp_layers": [16, 16]},
}
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp")


def test_every_plan_key_is_traced_or_declared_not_traced_with_why():
    from shardtune.verify.trace_inputs import NOT_TRACED, TRACED

    assert not TRACED & set(NOT_TRACED), TRACED & set(NOT_TRACED)
    missing = set(PLAN_KEYS) - TRACED - set(NOT_TRACED)
    assert not missing, f"PLAN_KEYS fields the simulator neither applies nor declares not traced: {missing}"
    assert TRACED | set(NOT_TRACED) == set(PLAN_KEYS), (TRACED | set(NOT_TRACED)) - set(PLAN_KEYS)
    assert all(len(why) > 20 for why in NOT_TRACED.values()), NOT_TRACED


def test_each_traced_input_reaches_the_traced_trainers_config():
    from shardtune.config import build_config
    from shardtune.config.plan_keys import read_key
    from shardtune.plan.validate import resolve_inputs
    from shardtune.verify.trace_inputs import TRACED, trace_recipe, untraceable_reason

    covered = {k for sample in TRACED_SAMPLES for k in sample} - {"gpus"}
    assert covered == TRACED, covered ^ TRACED
    for sample in TRACED_SAMPLES:
        inp = resolve_inputs(fields=sample)
        assert untraceable_reason(inp, "hsdp") is None
        recipe = trace_recipe(inp, "hsdp", "llama-3-8b")
        cfg = build_config(recipe)
        assert cfg.parallel.strategy == "hsdp"
        for field in TRACED:
            key = PLAN_KEYS[field]
            node = recipe
            for part in key.split("."):  # set by the table, not left to a default that happens to agree
                assert part in node, (field, key)
                node = node[part]
            if field in sample:
                assert read_key(cfg, key) == sample[field], (field, key, read_key(cfg, key))
        # the shard group is hsdp's: the other strategies take none (their config refuses one)
        assert build_config(trace_recipe(inp, "zero3", "llama-3-8b")).parallel.hsdp_shard_size is None


def test_each_untraced_input_is_refused_where_it_acts():
    from shardtune.plan.validate import resolve_inputs
    from shardtune.verify.trace_inputs import NOT_TRACED, untraceable_reason

    assert set(UNTRACED_SAMPLES) == set(NOT_TRACED), set(UNTRACED_SAMPLES) ^ set(NOT_TRACED)
    default = PlanInputs()
    for field, sample in UNTRACED_SAMPLES.items():
        assert sample[field] != getattr(default, field), field
        inp = resolve_inputs(fields={"model": "llama-3-8b", "gpus": 8, **sample})
        assert getattr(inp, field) == sample[field], field
        refused = {s: untraceable_reason(inp, s) for s in STRATEGIES}
        assert all(refused.values()), (field, refused)


def test_an_untraced_input_no_refusal_names_is_still_refused(monkeypatch):
    from shardtune.plan.validate import resolve_inputs
    from shardtune.verify import trace_inputs

    monkeypatch.setattr(trace_inputs, "REFUSALS", ())  # as if a refusal were forgotten
    for field in ("offload", "lora_rank", "cp", "activation_offload", "ep", "pp"):
        inp = resolve_inputs(fields={"model": "llama-3-8b", "gpus": 8, **UNTRACED_SAMPLES[field]})
        reason = trace_inputs.untraceable_reason(inp, "zero3")
        assert reason and reason.startswith(f"{field} ") and "is not traced" in reason, (field, reason)
    assert trace_inputs.untraceable_reason(resolve_inputs(fields={"model": "llama-3-8b"}), "zero3") is None


# --- the launch commands' layout options: the trainer's flag rows (config/flags.py), one per degree

def _command_options(*path: str) -> set[str]:
    from shardtune.cli import app

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return {opt for p in cmd.params for opt in p.opts}


def test_every_degree_is_a_flag_of_train_and_of_each_launch_command():
    from shardtune.config import ParallelConfig
    from shardtune.config.flags import LAUNCH_FLAGS
    from shardtune.layout import Layout

    # the degrees: the Layout's integer fields a recipe sets (parallel.<degree>)
    degrees = {f.name for f in dataclasses.fields(Layout) if f.type == "int"} & set(ParallelConfig.model_fields)
    assert {"tp", "cp", "ep", "pp"} <= degrees, degrees
    by_key = {f.key: f for f in TRAIN_FLAGS}
    flags = [by_key.get(f"parallel.{d}") for d in sorted(degrees)]
    assert all(flags), f"degrees without a trainer flag: {[d for d, f in zip(sorted(degrees), flags) if not f]}"
    assert {f.name for f in flags} | {"strategy"} == {f.name for f in LAUNCH_FLAGS}
    for path in (("train",), ("launch", "torchrun"), ("launch", "slurm"), ("launch", "k8s")):
        options = _command_options(*path)
        assert {f.option for f in LAUNCH_FLAGS} <= options, (path, {f.option for f in LAUNCH_FLAGS} - options)
