"""The rank side of tests/dist/_harness.py `launch`: the gloo process group a worker runs in, and
its per-rank result file (`rank<R>.json`, read back by `_harness.rank_results`)."""
from __future__ import annotations

import gc
import json
import os
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist


@contextmanager
def process_group(timeout_s: float = 60):
    """Yields (rank, world) inside an initialised gloo group; destroys it on the way out."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        yield rank, world
    finally:
        gc.collect()
        dist.destroy_process_group()


def write_result(out_dir: str | os.PathLike, rank: int, result) -> None:
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
