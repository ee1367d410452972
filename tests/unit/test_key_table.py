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
    {"lora.rank": 8, "lora.dropout": 0.0, "lora.target_parameters": ["experts.gate_up_proj"]},
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
