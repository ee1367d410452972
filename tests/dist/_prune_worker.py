"""The cases of tests/dist/test_prune.py in the shared 2-rank launch: two trainer runs in ONE run
folder (<out_dir>/run) through _ckpt_worker.run_case (the real trainer), and between them rank 0
puts two checkpoints that are not this run's beside the first run's, with a copy of each kept
outside the checkpoints folder to compare with afterwards."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import _ckpt_worker
import torch.distributed as dist

from shardtune.train.durable.ckpt_files import META_FILE, read_info


def _foreign(src: Path, dest: Path, **meta_changes) -> None:
    shutil.copytree(src, dest)
    meta = json.loads((dest / META_FILE).read_text())
    meta.update(meta_changes)
    if meta.get("run_id") is None:
        meta.pop("run_id")
    (dest / META_FILE).write_text(json.dumps(meta))


def run_case(case: dict, rank: int, world: int) -> dict:
    if "overrides" in case:  # a training run, always in the same run folder
        return _ckpt_worker.run_case({**case, "name": "run"}, rank, world)
    ckpts = Path(case["out_dir"]) / "run" / "checkpoints"
    if rank == 0:
        found = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
        result = {"after_run1": found}
        if found == ["step_3", "step_4"]:  # else the test reports what run 1 left
            result["run_ids"] = [read_info(ckpts / name).run_id for name in found]
            _foreign(ckpts / "step_4", ckpts / "step_9", step=9, run_id="another-run", saved_at=1.0)
            _foreign(ckpts / "step_3", ckpts / "step_1", step=1, run_id=None, saved_at=2.0)
            for name in ("step_9", "step_1"):
                shutil.copytree(ckpts / name, Path(case["out_dir"]) / "pristine" / name)
    dist.barrier()  # run 2 starts once the folders are in place
    return result if rank == 0 else {}
