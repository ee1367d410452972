"""A Mixtral / Qwen3-MoE folder written by transformers' `save_pretrained` (the Hub's per-expert
names) reads into shardtune's model as transformers' own `from_pretrained` fuses it, bit for bit,
whole and by a rank's rows (train/core/hub_layout.py); the preflight takes it; and the export's
renaming (`saved_names`) gives back the folder's own tensors."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.config import ModelConfig
from shardtune.train.core.hub_layout import saved_names
from shardtune.train.core.model import build_meta_model, pretrained_full_tensors

SMALL = dict(hidden_size=32, intermediate_size=24, moe_intermediate_size=24, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=96,
             num_local_experts=4, num_experts=4, num_experts_per_tok=2, dtype="float32")


def hub_folder(path, model_type: str):
    """A tiny random model of `model_type` saved by transformers 5's own `save_pretrained`."""
    cfg = AutoConfig.for_model(model_type, **SMALL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # fp32 values with all their bits (not the init's zeros and ones)
        for p in model.parameters():
            p.normal_(0, 1)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_a_save_pretrained_folder_reads_as_from_pretrained_fuses_it(tmp_path, model_type):
    folder = hub_folder(tmp_path / model_type, model_type)
    on_disk = load_file(str(folder / "model.safetensors"))
    assert any(".experts.0." in k for k in on_disk) and not any(k.endswith("gate_up_proj") for k in on_disk)
    want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    meta = build_meta_model(ModelConfig(name=str(folder), init="pretrained"))
    made = dict(pretrained_full_tensors(meta, [folder / "model.safetensors"]))
    assert set(made) == {n for n, _ in meta.named_parameters()}
    experts = [n for n in made if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 4
    for name, make in made.items():
        w = want[name]
        assert torch.equal(make().view(torch.uint8), w.view(torch.uint8)), name
        if w.ndim:  # a rank's rows: ep 2's halves, and an FSDP shard of 1 row
            for rows in (slice(0, w.shape[0] // 2), slice(w.shape[0] // 2, w.shape[0]), slice(1, 2)):
                assert torch.equal(make(rows).view(torch.uint8), w[rows].view(torch.uint8)), (name, rows)
    # the export's names: transformers' save layout of the fused tensors is the folder's own file
    back = saved_names(meta.config, {n: make() for n, make in made.items()})
    assert sorted(back) == sorted(on_disk)
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in on_disk.items())


def test_the_preflight_takes_a_per_expert_folder_and_refuses_a_missing_expert(tmp_path):
    from safetensors.torch import save_file

    from shardtune.errors import UserError
    from shardtune.train.launcher.preflight import _check_weights

    folder = hub_folder(tmp_path / "m", "mixtral")
    cfg = ModelConfig(name=str(folder), init="pretrained")
    _check_weights(cfg, {})
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match="experts"):
        _check_weights(cfg, {})
