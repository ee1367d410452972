"""Plans leave no decision to the user (issue 42 item 2), through the CLI: `--fit` keeps every
option given, `plan RECIPE key=value` takes overrides as train does, a communication-bound fit is
named with its lever, every memory column of the peak is shown, a sequence past the model's
trained context is one warning line."""
from __future__ import annotations

import json

import pytest

from shardtune.cli import main


def _json(argv, capsys) -> dict:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc in (0, None), err
    return json.loads(out)


def _candidates(fit: dict) -> list[dict]:
    return [fit["best"], *fit["ranked"], *fit["rejected"]]


def test_fit_keeps_a_given_precision_and_searches_it_otherwise(capsys):
    argv = ["plan", "llama-3-8b", "--gpus", "8", "--fit", "--json"]
    free = _json(argv, capsys)
    assert len({c["precision"] for c in _candidates(free)}) > 1  # not given: searched
    kept = _json([*argv, "--precision", "bf16-mixed"], capsys)
    assert {c["precision"] for c in _candidates(kept)} == {"bf16-mixed"}
    assert any("kept as given: precision bf16-mixed" in n for n in kept["notes"])


def test_fit_keeps_every_searched_option_given(capsys):
    fit = _json(["plan", "llama-3-8b", "--gpus", "8", "--fit", "--json", "--ac", "op", "--tp", "1",
                 "--micro-batch", "2", "--offload", "none"], capsys)
    for c in _candidates(fit):
        assert (c["ac"], c["tp"], c["micro_batch"], c["offload"]) == ("op", 1, 2, "none"), c


def test_plan_recipe_takes_key_value_overrides_as_train_does(capsys):
    base = _json(["plan", "recipes/tiny-cpu.yaml", "--gpus", "2", "--json"], capsys)
    over = _json(["plan", "recipes/tiny-cpu.yaml", "train.seq_len=64", "--gpus", "2", "train.micro_batch=3",
                  "--json"], capsys)
    assert base["inputs"]["seq_len"] != 64 and over["inputs"]["seq_len"] == 64
    assert base["inputs"]["micro_batch"] != 3 and over["inputs"]["micro_batch"] == 3
    from shardtune.config import load_recipe  # the same overrides through the trainer's reader
    assert load_recipe("recipes/tiny-cpu.yaml", ["train.seq_len=64"]).plan_inputs()["seq_len"] == 64


def test_plan_fit_keeps_an_override(capsys):
    fit = _json(["plan", "recipes/llama-3-8b-8xh100.yaml", "parallel.precision=bf16-mixed", "--fit", "--json"],
                capsys)
    assert {c["precision"] for c in _candidates(fit)} == {"bf16-mixed"}


@pytest.mark.parametrize("argv,fragment", [
    (["plan", "llama-3-8b", "train.seq_len=64"], "overrides apply to a recipe"),
    (["plan", "recipes/tiny-cpu.yaml", "train.seq_lenn=64"], "train.seq_lenn"),
    (["plan", "recipes/tiny-cpu.yaml", "seq_len"], "key.path=value"),
])
def test_bad_overrides_are_one_line(argv, fragment, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert fragment in err and len(err.strip().splitlines()) == 1, err
