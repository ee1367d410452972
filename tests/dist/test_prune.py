"""Pruning on 2 ranks (zero3, gloo), the real trainer in the tier's shared 2-rank launch
(_prune_worker.py through _ckpt_worker.py): keep K of this run's checkpoints, never another run's
(issue 15 item 3).

Run 1 saves every step to step 4 with keep 2: step_3 and step_4 are left. Then two checkpoints
that are not this run's are put beside them, as a user copying folders would: another run's (its
run_id changed, a higher step number, saved earlier) and one written before run ids (no run_id).
Run 2 resumes (auto: the last saved, step_4) to step 8 in the same run folder: this run's
step_3..step_6 go, step_7 and step_8 stay, the two others are untouched byte for byte; every
checkpoint left verifies against its checksums (integrity.py's reader on the files). The CLI's own
launch, resume and output folder are tests/e2e's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.train.durable import integrity
from shardtune.train.durable.ckpt_files import read_info

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_prune_worker.py"
# the recipe the test ran through the CLI before, as overrides (`name: prune` ... `keep: 2`)
RECIPE = ["name=prune", "model.name=tiny-llama", "data.generated_examples=200", "parallel.strategy=zero3",
          "parallel.precision=fp32", "train.micro_batch=2", "train.seq_len=64", "train.timeout_s=60",
          "checkpoint.every=1", "checkpoint.keep=2", "checkpoint.resume=auto"]


def world2_cases(d: Path) -> tuple[list[dict], float]:
    return [{"name": "run1", "overrides": [*RECIPE, "train.max_steps=4"]}, {"name": "foreign"},
            {"name": "run2", "overrides": [*RECIPE, "train.max_steps=8"]}], 150


DIST_LAUNCHES = {2: world2_cases}  # one shared launch per world (tests/dist/conftest.py)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.timeout(400, func_only=True)
def test_prune_keeps_k_of_this_run_and_never_touches_another_runs(dist_launch, request):
    d, ranks = dist_launch(request.module, 2)
    for r in ranks:
        assert r["run1"] == r["run2"] == {"outcome": "ok"}
    foreign = ranks[0]["foreign"]
    assert foreign["after_run1"] == ["step_3", "step_4"]
    run_id = foreign["run_ids"][1]
    assert run_id and foreign["run_ids"][0] == run_id
    ckpts = d / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1", "step_7", "step_8", "step_9"]
    assert all(_files(ckpts / name) == _files(d / "pristine" / name) for name in ("step_9", "step_1"))
    for name in ("step_7", "step_8"):
        info = read_info(ckpts / name)
        assert info.run_id == run_id and info.world_size == 2  # a resume keeps the run's id
    for name in ("step_1", "step_7", "step_8", "step_9"):
        info = read_info(ckpts / name)
        assert info.files and integrity.problems(info.path, info.files) == [], name
    steps = [json.loads(line)["step"] for line in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 8
