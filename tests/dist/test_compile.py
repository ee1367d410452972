"""train.compile (parallel/build.py `apply_compile`) on 2 gloo ranks, in ONE launch of _compile_worker.py.

Each case builds the same model eager and compiled in the same ranks and steps both on the same
batches (fp32, 4 steps; AC none / full / op / every 2nd layer; LoRA): the eager side is the
reference (its own parity with one process is tests/dist/test_train_parity.py). Checked: losses
and grad norms within 1e-5; state-dict keys are a plain transformers model's (no `_orig_mod.`);
the compile really ran (dynamo's graph count); validation with the (1, 2) dummy batch and sample
generation add no graph (no recompiles); activation checkpointing still recomputes under compile
(bytes saved for backward).
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_compile_worker.py"
LORA = {"rank": 4, "alpha": 8}


def _case(name, strategy, ac="none", **kw):
    return {"name": name, "parallel": {"strategy": strategy, "precision": "fp32", "activation_checkpointing": ac},
            "steps": 4, "rows": 8, "seq_len": 32, **kw}


CASES = [_case("zero3", "zero3"), _case("zero3_full_ac", "zero3", "full"), _case("zero3_op_ac", "zero3", "op"),
         _case("ddp_every_2nd_layer_ac", "ddp", "layer"), _case("zero2_lora", "zero2", lora=LORA)]


def world2_cases(d: Path) -> tuple[list[dict], float]:
    """CASES, the first with dynamo's caches and counters reset as in a fresh process (the shared
    launch's earlier cases may have compiled)."""
    return [{**c, "fresh_dynamo": i == 0} for i, c in enumerate(CASES)], 600


DIST_LAUNCHES = {2: world2_cases}  # one shared launch per world (tests/dist/conftest.py)


@pytest.mark.timeout(700, func_only=True)
@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_compiled_matches_eager_over_4_steps(world2, name):
    for r in world2:
        c = r[name]
        assert c["compiled_losses"] == pytest.approx(c["eager_losses"], abs=1e-5, rel=0)
        assert c["compiled_norms"] == pytest.approx(c["eager_norms"], rel=1e-5)
        assert c["compiled_keys"] == c["eager_keys"]


@pytest.mark.timeout(700, func_only=True)
def test_state_dict_keys_are_the_hf_names(world2):
    from transformers import AutoModelForCausalLM

    from shardtune.config import ModelConfig
    from shardtune.train.core.model import build_hf_config

    plain = AutoModelForCausalLM.from_config(build_hf_config(ModelConfig()), attn_implementation="sdpa")
    assert world2[0]["zero3"]["compiled_keys"] == list(plain.state_dict().keys())
    lora_keys = world2[0]["zero2_lora"]["compiled_keys"]
    assert not any("_orig_mod" in k for k in lora_keys) and any(".lora_A." in k for k in lora_keys)


@pytest.mark.timeout(700, func_only=True)
def test_one_graph_for_all_layers_and_no_recompile_from_validation_or_sampling(world2):
    for r in world2:
        first = r["zero3"]
        # 4 layers × 4 steps: dynamo compiled exactly one graph, shared by every layer
        assert (first["graphs_before"], first["graphs_after_train"]) == (0, 1)
        for name, c in r.items():
            assert c["graphs_after_eval"] == c["graphs_after_train"], name  # eager: no new shape compiled
            # a new model may add a graph (DDP's layers are another class; LoRA's first layer gets an
            # input without grad), never one per layer or per step
            assert c["graphs_after_train"] - c["graphs_before"] <= 2, name
        assert r["zero2_lora"]["sample"] == world2[0]["zero2_lora"]["sample"]  # ranks agree


@pytest.mark.timeout(700, func_only=True)
def test_activation_checkpointing_still_recomputes_under_compile(world2):
    for r in world2:
        full, none = r["zero3_full_ac"], r["zero3"]
        # full AC keeps only each layer's input, compiled or not; without AC compile saves several times more
        assert full["compiled_activation_bytes"] == full["eager_activation_bytes"]
        assert full["compiled_activation_bytes"] * 3 < none["compiled_activation_bytes"]
