"""The DPO summary lines (train/core/metrics.py dpo_lines, issue 42 item 5): margin, accuracy,
held-out preference accuracy, and the collapse warning (margin growth without held-out accuracy)."""
from __future__ import annotations

from shardtune.train.core.metrics import dpo_lines


def _rec(step, margin, acc, val=None):
    r = {"step": step, "loss": 0.6, "reward_margin": margin, "reward_acc": acc}
    return r | ({"val_pref_acc": val} if val is not None else {})


def test_a_healthy_run_names_margin_and_held_out_accuracy_without_a_warning():
    lines = dpo_lines([_rec(1, 0.0, 0.5), _rec(2, 0.4, 0.75), _rec(3, 0.9, 1.0, val=0.8)])
    assert lines == ["dpo: reward margin 0.000 (step 1) → 0.900 (step 3), reward accuracy 100.0%; "
                     "held-out preference accuracy 80.0% (step 3)"]


def test_margin_growth_at_chance_held_out_is_a_collapse_warning():
    # the case: margin 8.5, every answer identical, held-out pairs at chance
    lines = dpo_lines([_rec(1, 0.0, 0.5), _rec(50, 8.5, 1.0, val=0.5)])
    assert len(lines) == 2 and "grew by 8.50" in lines[1] and "collapsed" in lines[1]


def test_sft_has_no_dpo_lines_and_no_held_out_pairs_is_said():
    assert dpo_lines([{"step": 1, "loss": 2.0}]) == []
    assert "no held-out pairs" in dpo_lines([_rec(1, 0.1, 0.5)])[0]
