"""A Hub folder's `torch_dtype: bfloat16` does not turn bf16-mixed into pure bf16 (issue 14)."""
import json

import torch

from shardtune.catalog.models import resolve_model_config
from shardtune.config import ModelConfig
from shardtune.plan.validate import PlanInputs
from shardtune.train.core.model import build_meta_model
from shardtune.verify.simulate import simulate_strategy


def _folder(tmp_path, name, **extra):
    cfg = dict(resolve_model_config("tiny-llama"), **extra)
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_bf16_config_builds_fp32_masters(tmp_path):
    folder = _folder(tmp_path, "bf16", torch_dtype="bfloat16")
    model = build_meta_model(ModelConfig(name=str(folder)))
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_bf16_config_traces_the_same_states_as_a_folder_without_the_key(tmp_path):
    # the reference: the same architecture without torch_dtype (the analytic plan matched it to 0.0 %;
    # with the key the trace showed params/grads/optimizer at -50 %)
    plain = _folder(tmp_path, "plain")
    bf16 = _folder(tmp_path, "bf16", torch_dtype="bfloat16")
    for strategy in ("zero3", "ddp"):
        a = simulate_strategy(PlanInputs(str(plain), 2, precision="bf16-mixed", seq_len=64), strategy)
        b = simulate_strategy(PlanInputs(str(bf16), 2, precision="bf16-mixed", seq_len=64), strategy)
        for key in ("params", "grads", "optimizer"):
            assert a[key] > 0 and b[key] == a[key], (strategy, key, a[key], b[key])


def test_start_up_line_names_the_weights_source_and_stored_dtype(tmp_path):
    from safetensors.torch import save_file

    from shardtune.train.core.model import describe_weights

    folder = _folder(tmp_path, "hub", torch_dtype="bfloat16")
    assert describe_weights(ModelConfig(name=str(folder))) == "seeded random init"  # no safetensors yet
    assert describe_weights(ModelConfig(name="tiny-llama")) == "seeded random init"
    save_file({"w": torch.zeros(2, dtype=torch.bfloat16)}, str(folder / "model.safetensors"))
    line = describe_weights(ModelConfig(name=str(folder)))
    assert line.startswith(f"pretrained {folder} ") and line.endswith("bf16)")
    assert describe_weights(ModelConfig(name=str(folder), init="random")) == "seeded random init"
