"""rules/pipeline.py `settings_gap`, the one adapter of `pipeline_gap` (issue 38): a recipe (the
trainer's preflight and `launch`), a plan's inputs (`shardtune plan`'s note) and a --fit candidate
with its inputs (fit_pp.trainer_gap) each give the line `pipeline_gap` gives with the settings
spelt out by hand, for one unsupported setting at a time."""
from __future__ import annotations

import pytest

from shardtune.config import load_recipe
from shardtune.plan.fit import Candidate
from shardtune.plan.fit_pp import trainer_gap
from shardtune.plan.validate import PlanInputs
from shardtune.rules.pipeline import pipeline_gap, recipe_pipeline_gap, settings_gap

# (recipe override, PlanInputs field and value, pipeline_gap keyword and value): one setting the pipeline lacks
CASES = [
    ("parallel.pp_schedule=interleaved-1f1b", ("pp_schedule", "interleaved-1f1b"), ("schedule", "interleaved-1f1b")),
    ("parallel.offload=all", ("offload", "all"), ("offload", "all")),
    ("parallel.activation_offload=true", ("activation_offload", True), ("activation_offload", True)),
    ("lora.rank=8", ("lora_rank", 8), ("lora_rank", 8)),
    ("train.objective=dpo", ("objective", "dpo"), ("objective", "dpo")),
    ("optim.name=adamw-8bit", ("optimizer", "adamw-8bit"), ("optimizer", "adamw-8bit")),
    (None, (None, None), (None, None)),  # nothing missing: no gap
]


@pytest.mark.parametrize("override,field,kw", CASES, ids=[c[0] or "none" for c in CASES])
def test_every_adapter_gives_pipeline_gaps_line(override, field, kw):
    by_hand = {"schedule": "1f1b", "cp": 1, "precision": "fp32", "offload": "none", "activation_offload": False,
               "lora_rank": 0, "objective": "sft", "optimizer": "adamw"}
    if kw[0]:
        by_hand[kw[0]] = kw[1]
    want = pipeline_gap(2, strategy="zero3", **by_hand)
    assert (want is None) == (override is None)
    inputs = PlanInputs(model="llama-3-8b", pp=2, **{"precision": "fp32", **({field[0]: field[1]} if field[0] else {})})
    assert settings_gap(2, "zero3", inputs) == want
    cand = Candidate("zero3", "none", inputs.offload, 1, None, inputs.precision, True, 1.0, 1.0, {}, pp=2,
                     optimizer=inputs.optimizer, pp_schedule=inputs.pp_schedule,
                     activation_offload=inputs.activation_offload)
    assert trainer_gap(cand, inputs) == want
    recipe = load_recipe("recipes/tiny-cpu.yaml", ["parallel.strategy=zero3", "parallel.precision=fp32",
                                                   "train.grad_accum=2", *([override] if override else [])])
    assert recipe_pipeline_gap(recipe, 2) == want
