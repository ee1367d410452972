"""Checkpoint, resume and bad-numerics behaviour of the real trainer on gloo ranks.

The tier's shared 2- and 4-rank launches (tests/dist/conftest.py) and one 1-rank launch run every
case (2 ranks: straight runs, resumes under the same and other strategies, NaN steps; 4 ranks and 1
rank: resumes at another world size). The reference for a
resumed run is the same trainer run straight through, without stopping: "8 steps straight ==
4 steps, stop, resume, 4 steps". The global batch is the same at every world size (micro_batch ×
ranks = 4 rows), so the data stream and the token-mean loss are the same computation.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from _harness import launch

from shardtune.train.durable.ckpt_files import complete_checkpoints, read_info

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_ckpt_worker.py"
ROWS = 4  # global batch rows at every world size
BASE = ["model.name=tiny-llama", "data.generated_examples=200", "parallel.precision=fp32",
        "optim.lr=0.002", "optim.warmup_steps=2", "train.seq_len=64", "train.max_steps=8",
        "train.timeout_s=60", "checkpoint.keep=3", "checkpoint.every=4"]


def _case(name, strategy, world, *extra, resume="never", env=None):
    ov = [*BASE, f"parallel.strategy={strategy}", f"train.micro_batch={ROWS // world}",
          f"checkpoint.resume={resume}", *extra]
    return {"name": name, "overrides": ov, "env": env or {}}


def _run(tmp: Path, nproc: int, cases: list[dict], timeout_s: float) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "cases.json").write_text(json.dumps(cases))
    launch(WORKER, nproc, [str(tmp / "cases.json"), str(tmp)], timeout_s, tmp / "logs")
    return json.loads((tmp / "rank0.json").read_text())


def _losses(run: Path) -> dict[int, float | None]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def world2_cases(d: Path) -> tuple[list[dict], float]:
    """2 ranks: straight runs (zero3, ddp, zero1), resumes, NaN cases."""
    s4 = lambda name: str(d / name / "checkpoints" / "step_4")  # noqa: E731
    cases = [
        _case("z3_straight", "zero3", 2),
        _case("ddp_straight", "ddp", 2),
        _case("z1_straight", "zero1", 2),
        _case("z3_resume", "zero3", 2, resume=s4("z3_straight")),
        _case("ddp_resume", "ddp", 2, resume=s4("ddp_straight")),
        _case("z3_to_ddp", "ddp", 2, resume=s4("z3_straight")),
        _case("ddp_to_z2", "zero2", 2, resume=s4("ddp_straight")),
        _case("z3_to_z1", "zero1", 2, resume=s4("z3_straight")),
        _case("z1_to_z3", "zero3", 2, resume=s4("z1_straight")),
        _case("z3_to_offload", "zero3", 2, "parallel.offload=all", resume=s4("z3_straight")),
        _case("nan_once", "zero3", 2, "train.max_steps=6", "checkpoint.every=2", "checkpoint.keep=2",
              env={"SHARDTUNE_TEST_NAN_STEPS": "3"}),
        _case("nan_stop", "zero3", 2, "checkpoint.every=2", "train.max_bad_steps=3",
              env={"SHARDTUNE_TEST_NAN_STEPS": "3,4,5"}),
        _case("sigterm", "zero3", 2, "checkpoint.save_final=false", env={"SHARDTUNE_TEST_SIGTERM": "3:1"}),
    ]
    return cases, 200


def world4_cases(d: Path) -> tuple[list[dict], float]:
    """4 ranks resume the 2-rank checkpoints (the 2-rank launch runs first)."""
    cases = [_case("z3_w4", "zero3", 4, resume=str(d / "z3_straight/checkpoints/step_4")),
             _case("hsdp_w4", "hsdp", 4, "parallel.hsdp_shard_size=2",
                   resume=str(d / "ddp_straight/checkpoints/step_4"))]
    return cases, 150


DIST_LAUNCHES = {2: world2_cases, 4: world4_cases}  # one shared launch per world (tests/dist/conftest.py)


@pytest.fixture(scope="module")
def two(dist_launch, request) -> tuple[Path, dict]:
    d, results = dist_launch(request.module, 2)
    return d, results[0]


@pytest.fixture(scope="module")
def other_worlds(two, dist_launch, request, tmp_path_factory) -> dict[str, Path]:
    """4 ranks (the shared launch) and 1 rank (its own launch, in this process's own folder) resume
    the 2-rank checkpoints: {case: run folder}."""
    d2, _ = two
    d4, w4 = dist_launch(request.module, 4)
    assert d4 == d2 and {w4[0][n]["outcome"] for n in ("z3_w4", "hsdp_w4")} == {"ok"}, w4[0]
    w1 = tmp_path_factory.mktemp("ckpt_w1")
    _run(w1, 1, [_case("z3_w1", "zero3", 1, resume=str(d2 / "z3_straight/checkpoints/step_4"))], timeout_s=90)
    return {"z3_w4": d2 / "z3_w4", "hsdp_w4": d2 / "hsdp_w4", "z3_w1": w1 / "z3_w1"}


def _assert_continues(straight: Path, resumed: Path, tol: float) -> None:
    ref, got = _losses(straight), _losses(resumed)
    assert sorted(ref) == list(range(1, 9))
    assert sorted(got) == [5, 6, 7, 8], "a resumed run logs only the steps after the checkpoint"
    for s in range(5, 9):
        assert abs(got[s] - ref[s]) <= tol, (s, got[s], ref[s])


@pytest.mark.timeout(240, func_only=True)
@pytest.mark.parametrize("strategy", ["z3", "ddp"])
def test_eight_straight_equals_four_then_resume_four(two, strategy):
    d, results = two
    assert results[f"{strategy}_resume"]["outcome"] == "ok", results
    _assert_continues(d / f"{strategy}_straight", d / f"{strategy}_resume", 1e-6)
    rec = _records(d / f"{strategy}_resume")
    assert rec[0]["resumed_from"] == 4
    lr_ref = {r["step"]: r["lr"] for r in _records(d / f"{strategy}_straight")}
    assert all(abs(r["lr"] - lr_ref[r["step"]]) < 1e-12 for r in rec), "the LR schedule continues"


@pytest.mark.timeout(240, func_only=True)
@pytest.mark.parametrize("straight, resumed", [("z3_straight", "z3_to_ddp"), ("ddp_straight", "ddp_to_z2"),
                                                ("z3_straight", "z3_to_z1"), ("z1_straight", "z1_to_z3"),
                                                ("z3_straight", "z3_to_offload")])
def test_resume_under_another_strategy(two, straight, resumed):
    d, results = two
    assert results[resumed]["outcome"] == "ok", results
    _assert_continues(d / straight, d / resumed, 1e-5)


@pytest.mark.timeout(400, func_only=True)
@pytest.mark.parametrize("resumed", ["z3_w4", "hsdp_w4", "z3_w1"])
def test_resume_at_another_world_size(two, other_worlds, resumed):
    d2, _ = two
    straight = d2 / ("ddp_straight" if "hsdp" in resumed else "z3_straight")
    _assert_continues(straight, other_worlds[resumed], 1e-5)
    info = read_info(straight / "checkpoints" / "step_4")
    assert info.world_size == 2


@pytest.mark.timeout(240, func_only=True)
def test_layout_atomic_names_and_keep(two):
    d, _ = two
    ck = d / "z3_straight" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step_4", "step_8"]  # no temporaries left
    info = read_info(ck / "step_8")
    assert (info.step, info.world_size, info.strategy) == (8, 2, "zero3")
    names = {p.name for p in (ck / "step_8").iterdir()}
    assert {".metadata", "trainer.json", "rng_rank0.json", "rng_rank1.json", "hf"} <= names
    assert (ck / "step_8" / "hf" / "config.json").is_file()
    # keep=2 with saves at 2, 4, 6: step_2 was pruned
    assert [i.step for i in complete_checkpoints(d / "nan_once")] == [4, 6]


@pytest.mark.timeout(240, func_only=True)
def test_nan_step_is_skipped_and_the_run_continues(two):
    d, results = two
    assert results["nan_once"]["outcome"] == "ok", results
    rec = {r["step"]: r for r in _records(d / "nan_once")}
    assert sorted(rec) == [1, 2, 3, 4, 5, 6]
    assert rec[3]["skipped"] is True and rec[3]["loss"] is None
    assert all(rec[s]["loss"] is not None and rec[s]["loss"] < 10 for s in (1, 2, 4, 5, 6))
    # no optimizer or scheduler step on the skipped step: step 4 runs with step 3's lr
    assert rec[4]["lr"] == rec[3]["lr"] and rec[5]["lr"] != rec[4]["lr"]
    ref = _losses(d / "z3_straight")
    assert rec[1]["loss"] == pytest.approx(ref[1], abs=1e-6)  # same run up to the NaN
    events = [json.loads(line) for line in (d / "nan_once" / "events.jsonl").read_text().splitlines()]
    skipped = next(e for e in events if e["event"] == "skipped_step")
    assert {"event": "skipped_step", "step": 3}.items() <= skipped.items()


@pytest.mark.timeout(240, func_only=True)
def test_consecutive_nan_steps_stop_the_run_with_its_checkpoint_intact(two):
    d, results = two
    r = results["nan_stop"]
    assert r["outcome"] == "error"
    assert "3 consecutive steps (3-5)" in r["message"] and "non-finite" in r["message"]
    assert "step_4" in r["message"], "names the last good checkpoint"
    assert [i.step for i in complete_checkpoints(d / "nan_stop")] == [2, 4]
    assert max(_losses(d / "nan_stop")) == 5


@pytest.mark.timeout(240, func_only=True)
def test_sigterm_on_one_rank_saves_at_the_next_step_boundary_and_stops(two):
    d, results = two
    assert results["sigterm"]["outcome"] == "ok", results
    run = d / "sigterm"
    assert [i.step for i in complete_checkpoints(run)] == [3]  # every=4 and no final save: only this one
    assert sorted(_losses(run)) == [1, 2, 3]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "preempted" and e["step"] == 3 for e in events)
