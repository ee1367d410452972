"""Start N worker processes (gloo, 127.0.0.1, a free port); a dead rank or a timeout fails fast.

Each rank runs in its own session, so a timeout kills its whole process group; the first rank
that exits non-zero makes every other rank be killed (a peer blocked in a collective would
otherwise wait for the process-group timeout).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from shardtune.processes import free_port, kill_groups

REPO = Path(__file__).resolve().parents[2]

def launch(script: Path, nproc: int, args: list[str], timeout_s: float, log_dir: Path) -> None:
    """Run `python script *args` as ranks 0..nproc-1; raise AssertionError on failure or timeout."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        log = open(log_dir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                raise AssertionError(f"rank {failed[0]} exited with {codes[failed[0]]}:\n"
                                     + (log_dir / f"rank{failed[0]}.log").read_text()[-3000:])
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"timeout after {timeout_s} s; rank 0 log:\n"
                                     + (log_dir / "rank0.log").read_text()[-3000:])
            time.sleep(0.2)
    finally:
        kill_groups(procs)
        for log in logs:
            log.close()


def rank_results(out_dir: Path, nproc: int) -> list:
    """Each rank's `rank<R>.json` (written by `_rank.write_result`), rank 0 first."""
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(nproc)]
