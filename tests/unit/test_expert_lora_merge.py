"""LoRA on MoE experts (lora.target_parameters, PEFT's ParamWrapper) and DPO's load-balancing term,
on one process, against independent references: the per-expert merge written out as a loop over
experts and PEFT's own `merge_and_unload`; DPO's step against eq. 7 and transformers' own aux loss
(`output_router_logits=True`, `load_balancing_loss_func`) on the plain model."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from shardtune.config import DataConfig, LoraConfig, ModelConfig
from shardtune.errors import UserError
from shardtune.train.core import lora as lora_mod
from shardtune.train.core.model import build_meta_model, init_model_weights

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def _lora_model(rank: int = 4, modules=("q_proj",)):
    cfg = LoraConfig(rank=rank, alpha=8, target_modules=list(modules), target_parameters=EXPERTS)
    model = lora_mod.apply_lora(build_meta_model(ModelConfig(name="tiny-mixtral")), cfg)
    model.to_empty(device="cpu")
    init_model_weights(model, ModelConfig(name="tiny-mixtral"), seed=3)
    with torch.no_grad():  # B ≠ 0, so the adapters change the model
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_expert_delta_is_each_experts_own_b_times_a():
    """PEFT's 3-D layout: A [E·r, in] holds expert e's rows e·r..e·r+r-1, B [out, r·E] its columns
    e, e+E, ...: the delta of expert e is B_e A_e, written here as a loop."""
    E, r, d_out, d_in = 3, 2, 5, 4
    a, b = torch.randn(E * r, d_in), torch.randn(d_out, r * E)
    want = torch.stack([b[:, e::E] @ a[e * r:(e + 1) * r] for e in range(E)])
    torch.testing.assert_close(lora_mod.delta(a, b, E), want)
    w = torch.randn(E, d_out, d_in)
    torch.testing.assert_close(lora_mod.merged_weight(w, a, b, 0.5), w + 0.5 * want)
    torch.testing.assert_close(lora_mod.merged_weight(w[0], a[:r], b[:, :r], 2.0), w[0] + 2 * b[:, :r] @ a[:r])


def test_names_and_merge_equal_peft_merge_and_unload():
    model = _lora_model()
    names = dict(model.named_parameters())
    targets = lora_mod.adapted_weights(model)
    # PEFT nests one wrapper per parameter; which holds which is read from the model, and the base
    # names lose every '.base_layer'
    assert sorted(v for k, v in targets.items() if "layers.0." in k) == [
        "model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.self_attn.q_proj.weight"]
    assert lora_mod.base_name("m.experts.base_layer.base_layer.down_proj") == "m.experts.down_proj"
    assert not names["model.layers.0.mlp.gate.weight"].requires_grad  # the router stays frozen
    entries = [(n, n, tuple(p.shape), p.dtype) for n, p in names.items()]
    base, pairs = lora_mod.split_adapters(entries, targets)
    ours = {}
    for _, name, _, _ in base:
        w = names[next(n for n in names if lora_mod.base_name(n) == name)].detach()
        if name in pairs:
            w = lora_mod.merged_weight(w, names[pairs[name]["A"][1]].detach(), names[pairs[name]["B"][1]].detach(),
                                       lora_mod.scaling({"rank": 4, "alpha": 8}))
        ours[name] = w
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    merged = _peft_merge(model)
    sd = merged.state_dict()
    assert set(ours) == set(sd)
    for name, w in ours.items():
        torch.testing.assert_close(w, sd[name], atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trained, atol=1e-5, rtol=1e-5)


def _peft_merge(model):
    """PEFT's own merge of every outermost adapter layer (lora.Linear, nested ParamWrappers), unwrapped."""
    from peft.tuners.lora import LoraLayer

    model = copy.deepcopy(model)
    outer = [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)
             and not isinstance(model.get_submodule(name.rsplit(".", 1)[0]), LoraLayer)]
    for name, m in outer:
        parent, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        if hasattr(m, "unload_and_optionally_merge_module"):  # ParamWrapper: merges the nested ones too
            setattr(parent, attr, m.unload_and_optionally_merge_module(merge=True, safe_merge=False,
                                                                        adapter_names=None))
        else:
            m.merge()
            setattr(parent, attr, m.get_base_layer())
    return model


def test_expert_targets_refuse_dropout_nf4_and_nothing_in_one_line():
    with pytest.raises(ValueError, match="lora.dropout 0.1 with lora.target_parameters"):
        LoraConfig(rank=4, dropout=0.1, target_parameters=EXPERTS)
    with pytest.raises(ValueError, match="QLoRA of 3-D expert weights is not built"):
        LoraConfig(rank=4, quantize_base="nf4", target_parameters=EXPERTS)
    with pytest.raises(ValueError, match="both empty"):
        LoraConfig(rank=4, target_modules=[])
    with pytest.raises(UserError, match="target_parameters"):
        lora_mod.apply_lora(build_meta_model(ModelConfig(name="tiny-mixtral")),
                            LoraConfig(rank=4, target_parameters=["experts.no_such_weight"]))


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    from shardtune.processes import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dpo_step_adds_transformers_aux_loss_of_the_policy_forward(one_rank_group):
    """DPO's step on tiny-mixtral: its gradient is that of eq. 7 (sides scored from full logits) +
    router_aux_loss_coef × transformers' load_balancing_loss_func on the policy forward, and it
    logs that aux loss."""
    from shardtune.train.core.dpo import DPO
    from shardtune.train.core.step import StepOptions
    from shardtune.train.data.packing import build_row
    from shardtune.train.data.preference import encode_pair, pack_pairs
    from shardtune.train.data.tokenizer import ByteTokenizer

    model = build_meta_model(ModelConfig(name="tiny-mixtral"))
    model.to_empty(device="cpu")
    init_model_weights(model, ModelConfig(name="tiny-mixtral"), seed=3)
    plain = copy.deepcopy(model)
    tok, dcfg = ByteTokenizer(), DataConfig(tokenizer="byte", template="plain")
    pairs = [encode_pair({"prompt": "q:", "chosen": "yes please", "rejected": "nope"}, tok, dcfg),
             encode_pair({"prompt": "2+2=", "chosen": "4", "rejected": "five"}, tok, dcfg)]
    data = pack_pairs(pairs, 48, True, 0)
    rows = [torch.tensor([x]) for x in build_row(data, data.rows[0], tok.pad_id)]
    batch = {"input_ids": rows[0], "labels": rows[1], "position_ids": rows[2]}
    ref = torch.zeros(1, 24, 2)  # (B, P, 2), P = seq_len / 2 slots: a fixed reference for the 2 pairs
    ref[0, :2] = torch.tensor([[-30.0, -25.0], [-12.0, -20.0]])

    class Ref:
        def logps(self, b, opts):
            return ref

    opts = StepOptions(loss_chunks=1, grad_clip=0.0, objective="dpo", dpo_beta=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    result = DPO(Ref()).step(model, opt, sched, [dict(batch)], opts, dp_size=1)

    out = plain(input_ids=batch["input_ids"], position_ids=batch["position_ids"], output_router_logits=True)
    labels, seg = batch["labels"][0], (batch["position_ids"][0] == 0).long().cumsum(0) - 1  # labels: shifted
    logp = F.log_softmax(out.logits[0].float(), -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    sides = torch.zeros(int(seg.max()) + 1).index_add(0, seg, torch.where(labels != -100, logp, 0.0))[:4].view(2, 2)
    pi = 0.1 * (sides - ref[0, :2])
    hand = -F.logsigmoid(pi[:, 0] - pi[:, 1]).mean()
    (hand + plain.config.router_aux_loss_coef * out.aux_loss).backward()
    assert float(result.parts["aux_loss"]) == pytest.approx(float(out.aux_loss), abs=1e-6)
    assert float(result.loss_part) == pytest.approx(float(hand), abs=1e-5)
    got = dict(model.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)
