"""Pipeline parallelism's bad inputs and unverified combinations (issue 40): `shardtune train ... --pp N`
refuses each in one line, exit 2, before any process starts, naming the key."""
from __future__ import annotations

from pathlib import Path

import pytest
from _cli import refused_before_any_process

from shardtune.rules.pipeline import stage_layer_counts

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"
OK = ["train.grad_accum=2"]  # with --pp 2: a run that starts

CASES = [  # (extra arguments, what the line must name)
    (["--nproc", "3", "--pp", "3", "train.grad_accum=3"], "does not divide the model's 4 decoder layers"),
    (["--pp", "2", "parallel.pp_layers=[1,2]"], "sums to 3, not the model's 4 decoder layers"),
    (["--pp", "2", "parallel.pp_layers=[4]"], "must give 2 positive layer counts"),
    (["--pp", "1", "parallel.pp_layers=[4]"], "parallel.pp_layers splits the layers"),
    (["--pp", "2", "train.grad_accum=1"], "< pp 2: 1f1b needs at least one micro-batch per stage"),
    (["--nproc", "3", "--pp", "2"], "pp 2 does not divide world"),
    (["--pp", "2", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=2"],
     "parallel.pp_schedule 'interleaved-1f1b' (its multi-stage-per-rank runtime is untested on gloo"),
    (["--pp", "2", "parallel.pp_schedule=interleaved-1f1b"], "interleaved-1f1b takes 2 or more virtual stages"),
    (["--pp", "2", "parallel.pp_schedule=zbv"], "parallel.pp_schedule 'zbv' (--pp-schedule) is not one of"),
    (["--pp", "2", "parallel.pp_virtual_stages=2"], "1f1b with pp_virtual_stages 2"),
    (["--nproc", "4", "--pp", "2", "--cp", "2"], "parallel.cp 2"),
    (["--pp", "2", "--strategy", "ddp"], "parallel.strategy 'ddp'"),
    (["--pp", "2", "--lora-rank", "4"], "lora.rank 4"),
    (["--pp", "2", "train.objective=dpo"], "train.objective 'dpo'"),
    (["--pp", "2", "train.compile=true"], "train.compile true"),
]


@pytest.mark.parametrize(("extra", "says"), CASES, ids=[c[1][:40] for c in CASES])
def test_pipeline_refusals_are_one_line_before_any_process(monkeypatch, capsys, tmp_path, extra, says):
    argv = ["train", RECIPE, "--nproc", "2", "--output-dir", tmp_path / "run", *OK, *extra]
    line = refused_before_any_process(monkeypatch, capsys, argv)
    assert says in line, line


def test_even_and_explicit_splits():
    assert stage_layer_counts(4, 2, None) == [2, 2]
    assert stage_layer_counts(30, 3, None) == [10, 10, 10]
    assert stage_layer_counts(4, 2, [1, 3]) == [1, 3]
