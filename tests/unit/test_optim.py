"""train/core/optim.py: AdamW with stochastic rounding to bf16, against torch's AdamW and by hand."""
import pytest
import torch

from shardtune.train.core.optim import AdamWStochasticBF16, stochastic_round_to_bf16_


def test_on_fp32_params_it_is_torchs_adamw():
    torch.manual_seed(0)
    w = torch.randn(64, 32)
    ours, ref = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_ours, opt_ref = AdamWStochasticBF16([ours], **kw), torch.optim.AdamW([ref], foreach=False, **kw)
    for _ in range(5):
        g = torch.randn_like(w)
        ours.grad, ref.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_ref.step()
    torch.testing.assert_close(ours, ref, atol=1e-7, rtol=1e-6)
    for k in ("exp_avg", "exp_avg_sq", "step"):
        torch.testing.assert_close(opt_ours.state[ours][k], opt_ref.state[ref][k])


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    """1 + 2^-9 lies a quarter of the way from 1 to the next bf16, 1 + 2^-7 (8 significant
    bits): it must round up with probability 1/4, so the mean stays 1 + 2^-9."""
    torch.manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2**-9)
    r = stochastic_round_to_bf16_(x.clone()).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    up = (r > 1).float().mean().item()
    assert up == pytest.approx(0.25, abs=0.005)  # binomial σ ≈ 0.001
    assert r.mean().item() == pytest.approx(1.0 + 2**-9, abs=2e-5)
    exact = torch.tensor([1.5, -0.375, 0.0])  # bf16 values round to themselves
    assert torch.equal(stochastic_round_to_bf16_(exact.clone()).float(), exact)


def test_small_updates_survive_on_average_in_bf16():
    """One step at lr 1e-5 on N(0, 0.02) bf16 weights: Adam's first update is −lr·sign(g)
    exactly. Nearest rounding (torch's AdamW on bf16) loses most of it; stochastic rounding
    keeps it on average: mean(Δw · sign g) = −lr."""
    torch.manual_seed(0)
    w = (torch.randn(512, 512) * 0.02).bfloat16()
    g = torch.randn(512, 512).bfloat16()
    moved = {}
    for name, cls in (("ours", AdamWStochasticBF16), ("torch", torch.optim.AdamW)):
        p = torch.nn.Parameter(w.clone())
        p.grad = g.clone()
        cls([p], lr=1e-5, weight_decay=0.0).step()
        moved[name] = ((p.detach().float() - w.float()) * g.float().sign()).mean().item() / 1e-5
    assert moved["ours"] == pytest.approx(-1.0, abs=0.03)
    assert abs(moved["torch"] + 1.0) > 0.3  # why this optimizer exists
