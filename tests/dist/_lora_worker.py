"""One rank of the LoRA tests: the trainer-worker cases (_train_worker.run_case: parity, bytes,
frozen weights, a checkpoint to export) and real-trainer cases (_ckpt_worker.run_case: resume)
in ONE launch, so the imports (~7 s per process) are paid once.

argv: cases.json out_dir. A case with "overrides" goes to the real trainer, any other to the
trainer worker; rank<r>.json holds each case's result.
"""
from __future__ import annotations

import gc
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import _ckpt_worker  # noqa: E402
import _train_worker  # noqa: E402


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results = {}
    try:
        for case in cases:
            if "overrides" in case:
                results[case["name"]] = _ckpt_worker.run_case(case, out_dir, rank, world)
            else:
                results[case["name"]] = _train_worker.run_case(case, rank, world)
            dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
