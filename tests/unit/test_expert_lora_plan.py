"""The planner's expert LoRA adapters (plan/params.py `expert_lora_shapes`, from
`lora.target_parameters`) against the adapters PEFT's ParamWrapper builds on transformers' model
(train/core/lora.py `apply_lora` on the meta model), and their count by hand: r·E·(in + out) each."""
from __future__ import annotations

import pytest

from shardtune.catalog.models import resolve_model_config
from shardtune.config import LoraConfig, ModelConfig
from shardtune.errors import UserError
from shardtune.plan.model import _load_model
from shardtune.plan.params import architecture_from_config, expert_lora_shapes

TARGETS = ["experts.gate_up_proj", "experts.down_proj"]


@pytest.mark.parametrize("targets", [TARGETS, ["experts.down_proj"]])
def test_expert_adapters_are_the_ones_peft_builds(targets):
    from shardtune.train.core.lora import apply_lora
    from shardtune.train.core.model import build_meta_model

    model = build_meta_model(ModelConfig(name="tiny-mixtral", init="random"))
    apply_lora(model, LoraConfig(rank=8, target_modules=["q_proj"], target_parameters=targets))
    peft = sorted(tuple(p.shape) for n, p in model.named_parameters() if "lora_" in n and ".experts." in n)
    planned = expert_lora_shapes(architecture_from_config(resolve_model_config("tiny-mixtral")), 8, targets)
    assert sorted(p.shape for p in planned) == peft
    # by hand: 4 layers x r 8 x E 4 x (in + out): gate_up (128 + 256), down (128 + 128)
    per_layer = sum({"experts.gate_up_proj": 8 * 4 * (128 + 256), "experts.down_proj": 8 * 4 * 256}[t] for t in targets)
    assert sum(p.numel for p in planned) == 4 * per_layer


def test_plan_counts_them_as_trainable_and_refuses_a_name_it_lacks():
    plain = _load_model("tiny-mixtral", None, 8)
    experts = _load_model("tiny-mixtral", None, 8, target_parameters=TARGETS)
    assert experts.trainable - plain.trainable == 4 * 8 * 4 * (128 + 256 + 256)
    with pytest.raises(UserError, match="names no 3-D expert weight"):
        _load_model("tiny-mixtral", None, 8, target_parameters=["experts.up_proj"])
