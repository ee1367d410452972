"""GRPO / DAPO / Dr. GRPO's loss and advantages (train/core/rl_loss.py) against the papers' formulas
written here as plain Python loops over tokens (Shao et al. 2024 eq. 3 and the k3 KL of eq. 4;
Yu et al. 2025 eq. 8; Liu et al. 2025 §3.2, as TRL's GRPOTrainer normalises each), and the
KV-cached group sampler (rl_generate.py) against transformers' own greedy `generate`."""
from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from shardtune.train.core.rl_loss import group_advantages, reduce_loss, token_terms

B, T, MAX_NEW = 6, 5, 7


def case(seed: int):
    rnd = random.Random(seed)
    lengths = [rnd.randint(1, T) for _ in range(B)]
    mask = [[t < n for t in range(T)] for n in lengths]
    logp = [[-rnd.uniform(0.1, 3) for _ in range(T)] for _ in range(B)]
    old = [[v + rnd.uniform(-0.4, 0.4) for v in row] for row in logp]  # ratios in about [0.67, 1.5]
    ref = [[v + rnd.uniform(-0.5, 0.5) for v in row] for row in logp]
    adv = [rnd.uniform(-2, 2) for _ in range(B)]
    return logp, old, ref, adv, mask


def paper_loss(variant, logp, old, ref, adv, mask, eps_low, eps_high, beta):
    per_seq, total, tokens = [], 0.0, 0
    for i in range(B):
        s, n = 0.0, 0
        for t in range(T):
            if not mask[i][t]:
                continue
            r = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            kl = math.exp(ref[i][t] - logp[i][t]) - (ref[i][t] - logp[i][t]) - 1
            term = -min(r * adv[i], clipped * adv[i]) + beta * kl
            s, n = s + term, n + 1
        per_seq.append(s / n)
        total, tokens = total + s, tokens + n
    return {"grpo": sum(per_seq) / B, "dapo": total / tokens, "dr_grpo": total / (B * MAX_NEW)}[variant]


def ours(variant, logp, old, ref, adv, mask, eps_low, eps_high, beta, split=(0, B)) -> torch.Tensor:
    """The parts of rows [split) with the global counts (one rank's share)."""
    lo, hi = split
    t = lambda x: torch.tensor(x[lo:hi], dtype=torch.float64)  # noqa: E731
    m = torch.tensor(mask[lo:hi])
    terms = token_terms(t(logp), t(old), t(adv), eps_low, eps_high, beta, t(ref))
    return reduce_loss(terms.loss, m, variant, num_completions=torch.tensor(float(B)),
                       num_tokens=torch.tensor(float(sum(map(sum, mask)))), max_new_tokens=MAX_NEW)


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("eps_low, eps_high, beta", [(0.2, 0.2, 0.0), (0.2, 0.28, 0.0), (0.1, 0.3, 0.04)])
def test_each_variant_equals_the_papers_formula_and_ranks_sum_to_it(variant, eps_low, eps_high, beta):
    for seed in range(3):
        args = case(seed)
        want = paper_loss(variant, *args, eps_low, eps_high, beta)
        got = ours(variant, *args, eps_low, eps_high, beta)
        assert abs(float(got) - want) < 1e-12, (variant, seed, float(got), want)
        two_ranks = ours(variant, *args, eps_low, eps_high, beta, (0, 2)) + ours(
            variant, *args, eps_low, eps_high, beta, (2, B))
        assert abs(float(two_ranks) - want) < 1e-12


def test_gradient_at_ratio_one_is_the_policy_gradient():
    """μ = 1: old = the detached current log-probs, so d loss / d log π(o_it) = −A_i / |o_i| / B (grpo)."""
    logp, _, ref, adv, mask = case(7)
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    terms = token_terms(lp, lp.detach(), torch.tensor(adv, dtype=torch.float64), 0.2, 0.2)
    reduce_loss(terms.loss, torch.tensor(mask), "grpo", num_completions=torch.tensor(float(B)),
                num_tokens=torch.tensor(1.0), max_new_tokens=MAX_NEW).backward()
    for i in range(B):
        n = sum(mask[i])
        for t in range(T):
            want = -adv[i] / n / B if mask[i][t] else 0.0
            assert abs(float(lp.grad[i, t]) - want) < 1e-12
    assert not terms.clipped.any()


def test_clip_fraction_counts_the_tokens_the_clip_stops():
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1]], dtype=torch.float64))  # ratios against old = 0
    terms = token_terms(lp, torch.zeros_like(lp), torch.tensor([1.0]), 0.2, 0.28)
    assert terms.clipped.tolist() == [[True, False, False]]  # A > 0: only a ratio above 1.28 is clipped
    terms = token_terms(lp, torch.zeros_like(lp), torch.tensor([-1.0]), 0.2, 0.28)
    assert terms.clipped.tolist() == [[False, True, False]]  # A < 0: only a ratio below 0.8


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_by_statistics(scale):
    rnd = random.Random(3)
    rewards = [rnd.choice([0.0, 0.5, 1.0]) for _ in range(12)]
    adv, std = group_advantages(torch.tensor(rewards, dtype=torch.float64), 4, scale)
    for g in range(3):
        grp = rewards[4 * g:4 * g + 4]
        mean, sd = statistics.fmean(grp), statistics.stdev(grp)
        assert abs(float(std[g]) - sd) < 1e-12
        for k, r in enumerate(grp):
            want = (r - mean) / (sd + 1e-4) if scale else r - mean
            assert abs(float(adv[4 * g + k]) - want) < 1e-9


def test_kv_cached_greedy_group_equals_transformers_generate():
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardtune.train.core.rl_generate import sample_group

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    prompt = [5, 17, 42, 8]
    want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    g = sample_group(model, prompt, 3, max_new_tokens=12, stop_ids=[want[5]], pad_id=0, temperature=0.0,
                     top_p=1.0, seed=0)
    stop = want.index(want[5]) + 1  # stops at the first stop id, which it keeps
    assert g.completion_ids() == [want[:stop]] * 3
    a = sample_group(model, prompt, 4, max_new_tokens=12, stop_ids=[], pad_id=0, temperature=1.0, top_p=0.9, seed=5)
    b = sample_group(model, prompt, 4, max_new_tokens=12, stop_ids=[], pad_id=0, temperature=1.0, top_p=0.9, seed=5)
    assert a.completion_ids() == b.completion_ids() and len({tuple(c) for c in a.completion_ids()}) > 1
