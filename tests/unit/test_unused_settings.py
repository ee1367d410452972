"""A setting the objective ignores is one warning line from `shardtune train` (issue 42): said
once by the launcher, before any process starts; settings that act stay silent."""
from __future__ import annotations

import subprocess

import pytest

from shardtune import cli
from shardtune.config import load_recipe
from shardtune.errors import UserError
from shardtune.train.launcher import supervise


def test_reference_under_sft_and_simpo_is_named():
    assert load_recipe(None, ["train.reference=precompute"]).train.unused_settings() == [
        "train.reference is set but does nothing under train.objective sft (it acts under dpo); remove it, "
        "or set train.objective"]
    simpo = load_recipe(None, ["train.objective=simpo", "train.reference=live", "train.dpo_label_smoothing=0.1"])
    assert [line.split()[0] for line in simpo.train.unused_settings()] == ["train.reference",
                                                                           "train.dpo_label_smoothing"]


@pytest.mark.parametrize("overrides", [[], ["train.objective=dpo", "train.reference=precompute"],
                                       ["train.objective=simpo", "train.simpo_gamma=1.0", "train.dpo_beta=2.0"]])
def test_settings_that_act_are_silent(overrides):
    assert load_recipe(None, overrides).train.unused_settings() == []


def test_shardtune_train_warns_once_before_any_process(monkeypatch, capsys, tmp_path):
    def stop(*a, **k):  # the run lock is the launcher's next step: stop there, no process started
        raise UserError("stopped after the checks")

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    monkeypatch.setattr(supervise, "RunLock", stop)
    rc = cli.main(["train", "recipes/tiny-cpu.yaml", "--output-dir", str(tmp_path / "run"),
                   "train.reference=precompute"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err[-1].endswith("stopped after the checks"), err
    assert [line for line in err if "warning" in line] == [
        "shardtune: warning: train.reference is set but does nothing under train.objective sft (it acts under "
        "dpo); remove it, or set train.objective"]
