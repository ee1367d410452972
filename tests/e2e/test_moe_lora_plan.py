"""The planner's expert LoRA (`lora.target_parameters`, plan/params.py `expert_lora_shapes`) against
the trainer: `shardtune train recipes/tiny-moe-cpu.yaml --nproc 2 lora.rank=8
'lora.target_parameters=[experts.gate_up_proj,experts.down_proj]'` (zero3, fp32, one step): each rank's
parameter, gradient and optimizer bytes (memory.json, the trainer's storage count) equal the plan the
run wrote (plan.json, from the same recipe keys), to the byte. Before the planner counted them, the
gradients were planned at 0.11 MiB against 0.37 MiB measured."""
from __future__ import annotations

import json

import pytest
from _cli import REPO, shardtune_cli

pytestmark = [pytest.mark.e2e]


@pytest.mark.timeout(600)
def test_expert_lora_states_per_rank_equal_the_planners(tmp_path):
    run = tmp_path / "run"
    proc = shardtune_cli("train", REPO / "recipes" / "tiny-moe-cpu.yaml", "--nproc", "2", "--output-dir", run,
                         "lora.rank=8", "lora.target_parameters=[experts.gate_up_proj,experts.down_proj]",
                         "train.max_steps=1", timeout_s=420)
    assert proc.returncode == 0, proc.stdout[-3000:]
    plan = json.loads((run / "plan.json").read_text())
    # q, k, v, o adapters (7,168 a layer) and the experts' (gate_up 12,288 + down 8,192 a layer), 4 layers
    assert plan["model"]["trainable_params"] == 4 * (7168 + 12288 + 8192)
    planned = plan["strategies"][0]["memory"]
    ranks = json.loads((run / "memory.json").read_text())["per_rank"]
    assert len(ranks) == 2
    for rank in ranks:
        for key in ("params", "grads", "optimizer"):
            assert rank[f"{key}_bytes"] == planned[key], (key, rank[f"{key}_bytes"], planned[key])
