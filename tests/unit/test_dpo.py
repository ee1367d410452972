"""DPO's pieces against independent references: chunked per-token log-probs (and their gradients) vs
torch's log_softmax on full logits, the loss vs eq. 7 of Rafailov et al. 2023 written out, the pair
formats (strings, UltraFeedback message lists) and the packing (a pair's sides share a row)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardtune.config import DataConfig
from shardtune.errors import UserError
from shardtune.train.core.dpo import _per_side, chunked_token_logps, dpo_losses, valid_pairs
from shardtune.train.data.packing import build_row
from shardtune.train.data.preference import encode_pair, normalize_pair, pack_pairs
from shardtune.train.data.tokenizer import ByteTokenizer


@pytest.mark.parametrize("chunks", [1, 3, 7])
def test_chunked_logps_and_grads_equal_full_log_softmax(chunks):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(10, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 40, (10,), generator=g)
    target[[2, 7]] = -100
    coef = torch.randn(10, generator=g, dtype=torch.float64)
    got = chunked_token_logps(h, w, target, chunks)
    (got.double() * coef).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    full = F.log_softmax(h @ w.t(), -1).gather(1, target.clamp(min=0)[:, None])[:, 0]
    want = torch.where(target != -100, full, 0.0)
    (want * coef).sum().backward()
    assert torch.allclose(got.double(), want, atol=1e-6)  # the forward runs in fp32
    assert torch.allclose(gh, h.grad, atol=1e-5) and torch.allclose(gw, w.grad, atol=1e-5)


def test_dpo_loss_is_eq7_with_label_smoothing():
    pol = torch.tensor([[-3.0, -5.0], [-2.0, -1.0]])
    ref = torch.tensor([[-4.0, -4.0], [-2.5, -1.5]])
    beta, eps = 0.5, 0.1
    losses, rc, rr = dpo_losses(pol, ref, beta, eps)
    for i in range(2):
        z = beta * ((pol[i, 0] - ref[i, 0]) - (pol[i, 1] - ref[i, 1]))
        sig = 1 / (1 + math.exp(-z))
        assert losses[i].item() == pytest.approx(-(1 - eps) * math.log(sig) - eps * math.log(1 - sig), rel=1e-6)
        assert rc[i].item() == pytest.approx(beta * float(pol[i, 0] - ref[i, 0]))
        assert rr[i].item() == pytest.approx(beta * float(pol[i, 1] - ref[i, 1]))


def test_pair_formats():
    s = normalize_pair({"prompt": "p?", "chosen": "yes", "rejected": "no"}, "row 1")
    assert s == {"prompt": "p?", "chosen": "yes", "rejected": "no"}
    user = {"role": "user", "content": "p?"}
    uf = normalize_pair({"prompt": "p?", "chosen": [user, {"role": "assistant", "content": "yes"}],
                         "rejected": [user, {"role": "assistant", "content": "no"}]}, "row 1")
    assert uf == {"messages": [user], "chosen": "yes", "rejected": "no"}
    implicit = normalize_pair({"chosen": [user, {"role": "assistant", "content": "yes"}],
                               "rejected": [user, {"role": "assistant", "content": "no"}]}, "row 1")
    assert implicit == uf
    renamed = normalize_pair({"q": "p?", "good": "yes", "bad": "no"}, "row 1",
                             columns={"prompt": "q", "chosen": "good", "rejected": "bad"})
    assert renamed == s
    with pytest.raises(UserError, match=r"columns \['prompt', 'response'\]"):
        normalize_pair({"prompt": "p?", "response": "r"}, "row 1")
    with pytest.raises(UserError, match="'rejected' side is empty"):
        normalize_pair({"prompt": "p?", "chosen": "yes", "rejected": "  "}, "row 1")


def test_encoded_pair_masks_the_prompt_and_packs_sides_together():
    tok, cfg = ByteTokenizer(), DataConfig(tokenizer="byte", template="plain")
    pairs = [{"prompt": f"q{i}:", "chosen": "right" * (i + 1), "rejected": "no"} for i in range(5)]
    enc = [encode_pair(p, tok, cfg) for p in pairs]
    (ids_c, m_c), (ids_r, m_r) = enc[0]
    assert bytes(i for i, m in zip(ids_c, m_c) if m and i < 256) == b"right"  # targets: response + eos only
    assert bytes(i for i, m in zip(ids_r, m_r) if m and i < 256) == b"no"
    data = pack_pairs(enc, seq_len=48, packing=True, seed=0)
    assert sorted(k for row in data.rows for k in row) == list(range(10))
    for row in data.rows:
        assert all(row[j] % 2 == 0 and row[j + 1] == row[j] + 1 for j in range(0, len(row), 2))
    # the step finds each side of each pair from the position restarts
    row = max(data.rows, key=len)
    ids, labels, pos = map(lambda x: torch.tensor([x]), build_row(data, row, tok.pad_id))
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos}
    counts = _per_side((labels != -100).float(), batch)[0]
    for j in range(len(row) // 2):
        for s in (0, 1):
            k = row[2 * j + s]
            assert counts[j, s] == sum(data.targets[data.offsets[k] + 1:data.offsets[k + 1]])
    assert valid_pairs(batch)[0].sum() == len(row) // 2


def test_reference_cache_of_other_inputs_or_altered_is_named_and_not_used(tmp_path, capsys):
    import numpy as np

    from shardtune.train.core.dpo_ref import _load, _save

    folder, arr = tmp_path / "ref-abc", np.array([-1.5, -2.25, -3.0, -0.5])
    inputs = {"data": {"seq_len": 64}, "weights": [["model.safetensors", 10, 1]]}
    _save(folder, inputs, arr)
    assert (_load(folder, inputs, 4) == arr).all()
    other = {**inputs, "weights": [["model.safetensors", 11, 2]]}  # another model
    assert _load(folder, other, 4) is None and "weights differ" in capsys.readouterr().err
    np.save(folder / "ref_logps.npy", arr + 1)  # altered after it was written
    assert _load(folder, inputs, 4) is None and "does not match meta.json" in capsys.readouterr().err


def test_lora_reference_is_the_base_model_with_full_logits():
    """AdaptersOffReference on a LoRA model (B ≠ 0) = the model before the adapters were injected,
    scored here from its full logits; the adapters are on again afterwards."""
    import copy

    from peft import inject_adapter_in_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtune.config import LoraConfig
    from shardtune.train.core.dpo import sequence_logps
    from shardtune.train.core.dpo_ref import AdaptersOffReference
    from shardtune.train.core.lora import peft_config
    from shardtune.train.core.step import StepOptions

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    policy = inject_adapter_in_model(peft_config(LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])),
                                     copy.deepcopy(base))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    tok, cfg = ByteTokenizer(), DataConfig(tokenizer="byte", template="plain")
    data = pack_pairs([encode_pair({"prompt": "q:", "chosen": "yes", "rejected": "nope"}, tok, cfg)], 32, False, 0)
    ids, labels, pos = (torch.tensor([x]) for x in build_row(data, data.rows[0], tok.pad_id))
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos}
    opts = StepOptions(loss_chunks=1)
    before = sequence_logps(policy, batch, 1)
    got = AdaptersOffReference(policy).logps(batch, opts)
    with torch.no_grad():
        logp = F.log_softmax(base(input_ids=ids, position_ids=pos).logits[0].float(), -1)
    want = []
    for k in data.rows[0]:  # each side: the sum over its target labels
        a, b = data.offsets[k] - data.offsets[data.rows[0][0]], data.offsets[k + 1] - data.offsets[data.rows[0][0]]
        want.append(sum(float(logp[t, labels[0, t]]) for t in range(a, b) if labels[0, t] != -100))
    assert got[0, 0].tolist() == pytest.approx(want, abs=1e-4)
    assert not torch.allclose(before[0, 0], got[0, 0], atol=1e-3)  # the adapters do change the policy
    assert torch.equal(sequence_logps(policy, batch, 1), before)  # and are on again


def test_report_draws_rewards_for_dpo_runs_only(tmp_path):
    from shardtune.report.plots import plot_rewards

    dpo = [{"step": s, "loss": 0.6, "reward_acc": 0.5 + s / 10, "reward_margin": s / 10, "reward_chosen": s / 20,
            "reward_rejected": -s / 20} for s in (1, 2, 3)]
    dpo[-1].update(val_loss=0.6, val_reward_acc=0.7, val_reward_margin=0.2, val_pref_acc=0.6)
    assert plot_rewards(dpo, tmp_path / "rewards.png", "run").stat().st_size > 10_000
    assert plot_rewards([{"step": 1, "loss": 2.0}], tmp_path / "sft.png", "run") is None


def test_simpo_loss_is_eq6():
    """SimPO (Meng et al. 2024 eq. 6) written out: −log σ(β/|y_w| log π(y_w) − β/|y_l| log π(y_l) − γ)."""
    from shardtune.train.core.dpo import simpo_losses

    pol, lengths = torch.tensor([[-6.0, -4.0], [-3.0, -9.0]]), torch.tensor([[3.0, 1.0], [2.0, 3.0]])
    beta, gamma = 2.0, 0.5
    losses, rc, rr = simpo_losses(pol, lengths, beta, gamma)
    for i in range(2):
        z = beta * float(pol[i, 0] / lengths[i, 0]) - beta * float(pol[i, 1] / lengths[i, 1]) - gamma
        assert losses[i].item() == pytest.approx(math.log1p(math.exp(-z)), rel=1e-6)
        assert rc[i].item() == pytest.approx(beta * float(pol[i, 0] / lengths[i, 0]))


@pytest.mark.parametrize("objective,reference,factor", [("dpo", "live", 4 / 3), ("simpo", "live", 1)])
def test_the_objective_object_carries_the_loops_flops_factor_and_token_count(objective, reference, factor):
    """The loop's MFU counts a live reference's forward: a trained token costs forward + backward =
    2N + 4N FLOPs, the reference's forward 2N more: 8N / 6N = 4/3 (docs/dpo.md); simpo holds no
    reference (and dpo's precompute drops it before training: set_up_dpo's DPO(None)), so 1. The
    objects set_up_dpo builds say so; SFT and GRPO by their classes (GRPO counts its completions)."""
    from types import SimpleNamespace

    from shardtune.train.core.dpo import DPO
    from shardtune.train.core.dpo_ref import set_up_dpo
    from shardtune.train.core.grpo import GRPO
    from shardtune.train.core.sft import SFT

    cfg = SimpleNamespace(train=SimpleNamespace(objective=objective, reference=reference),
                          lora=SimpleNamespace(rank=8))  # LoRA: the reference is the base, nothing to build
    built = set_up_dpo(cfg, None, torch.nn.Linear(2, 2), None, None, None, None, None)
    assert built.flops_factor == pytest.approx(factor) and built.step_tokens_fixed
    assert DPO(None).flops_factor == 1  # what precompute leaves
    assert SFT().flops_factor == 1 and SFT().step_tokens_fixed
    assert GRPO.flops_factor == 1 and not GRPO.step_tokens_fixed
