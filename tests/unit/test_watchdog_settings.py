"""train.watchdog_s, train.watchdog_first_step_s and SHARDTUNE_WATCHDOG_S (issue 42 item 1): a bad
value is one line, exit 2, before torchrun or a rank starts; 0 or off turns the watchdog off."""
from __future__ import annotations

from pathlib import Path

import pytest
from _cli import refused_before_any_process

from shardtune.config import load_recipe

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", ["abc", "5s", "-5", "nan", "inf"])
def test_a_bad_variable_or_key_is_refused_before_any_process(monkeypatch, capsys, tmp_path, value):
    monkeypatch.setenv("SHARDTUNE_WATCHDOG_S", value)
    err = refused_before_any_process(monkeypatch, capsys, ["train", RECIPE, "--nproc", "2", "--output-dir",
                                                           tmp_path / "run"])
    assert f"SHARDTUNE_WATCHDOG_S = {value!r} is not a number of seconds" in err and "train.watchdog_s" in err
    monkeypatch.delenv("SHARDTUNE_WATCHDOG_S")
    for key in ("train.watchdog_s", "train.watchdog_first_step_s"):
        err = refused_before_any_process(monkeypatch, capsys, ["train", RECIPE, "--nproc", "2", "--output-dir",
                                                               tmp_path / "run", f"{key}={value}"])
        assert f"{key} = " in err and "is not a number of seconds" in err


def test_zero_and_off_turn_it_off_and_the_variable_wins_over_the_recipe(monkeypatch):
    monkeypatch.delenv("SHARDTUNE_WATCHDOG_S", raising=False)
    train = load_recipe(RECIPE).train
    assert (train.watchdog_s, train.watchdog_first_step_s) == (120, 900)
    for off in ("0", "off", "OFF"):
        assert load_recipe(RECIPE, [f"train.watchdog_s={off}"]).train.watchdog_s == 0
    assert load_recipe(RECIPE, ["train.watchdog_first_step_s=off"]).train.watchdog_first_step_s == 0
    monkeypatch.setenv("SHARDTUNE_WATCHDOG_S", "off")
    assert load_recipe(RECIPE, ["train.watchdog_s=300"]).train.watchdog_s == 0
    monkeypatch.setenv("SHARDTUNE_WATCHDOG_S", "45")
    assert load_recipe(RECIPE).train.watchdog_s == 45


def test_the_watcher_module_imports_no_torch():
    """issue 38 item 6: a fresh watcher interpreter would double each rank's imports."""
    import subprocess
    import sys

    code = "import sys, shardtune.train.durable.watchdog; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
