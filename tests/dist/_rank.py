"""The rank side of tests/dist/_harness.py `launch`: the gloo process group a worker runs in, its
per-rank result file (`rank<R>.json`, read back by `_harness.rank_results`), and `serve`, the one
main() of the case workers.

A case worker is a module with `run_case(case, rank, world) -> dict` whose `__main__` calls
`serve(run_case)`: argv is `cases.json out_dir`, every case runs in the same processes (imports cost
~7 s a process, so cases share them) and rank<R>.json maps each case's name (or its `key`) to what
it measured. A case may name another worker module (`"worker": "_ckpt_worker"`): its `run_case`
runs it, so cases of several test files share one launch (tests/dist/conftest.py `dist_launch`)."""
from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from shardtune.processes import exit_now


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


def tree_cpu_s() -> float:
    """CPU seconds of this process and its descendants so far (inductor's compile workers
    and its g++ runs are subprocesses): live ones' own times plus every reaped child's."""
    try:
        import psutil  # noqa: PLC0415 (not a declared dependency: without it, this process alone)
    except ImportError:
        return time.process_time()
    total = 0.0
    for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # ended between the listing and the read
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def serve(run_case: Callable[[dict, int, int], dict] | None, timeout_s: float = 60) -> None:
    """argv: cases.json out_dir. Runs each case (`case["out_dir"]` is out_dir unless the case gives
    its own) with `run_case` or its own worker's, a barrier after each, then writes rank<R>.json
    {key or name: result} and times<R>.json {key or name: [wall s, CPU s of this rank and its subprocesses]} (kept out
    of the results, which tests compare), and ends the process."""
    cases = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    results, times = {}, {}
    with process_group(timeout_s) as (rank, world):
        for case in cases:
            case = {"out_dir": str(out_dir), **case}
            key, t0, c0 = case.get("key", case["name"]), time.perf_counter(), tree_cpu_s()
            run = importlib.import_module(case["worker"]).run_case if "worker" in case else run_case
            results[key] = run(case, rank, world)
            dist.barrier()
            times[key] = [round(time.perf_counter() - t0, 2), round(tree_cpu_s() - c0, 2)]
    write_result(out_dir, rank, results)
    (out_dir / f"times{rank}.json").write_text(json.dumps(times, indent=0))
    exit_now(0)  # as a rank does (shardtune/processes.py): no interpreter finalization after the group


def build_case(case: dict, world: int):
    """A worker case's parts as the trainer builds them: (parallel config, mesh, dp rank, dp size,
    dp group, model, optimizer, scheduler). A case gives `parallel` (ParallelConfig fields), `steps`
    and optionally `model`, `lora` and `lr`; AdamW at constant lr, clip 1.0, no decay."""
    import torch  # noqa: PLC0415 lazy: serve() runs in workers that need no model

    from shardtune.config import LoraConfig, ModelConfig, OptimConfig, ParallelConfig  # noqa: PLC0415
    from shardtune.parallel.mesh import build_mesh, dp_group, dp_rank_size  # noqa: PLC0415
    from shardtune.train.core.model import build_model  # noqa: PLC0415
    from shardtune.train.core.optim import build_optimizer, build_scheduler  # noqa: PLC0415

    pcfg = ParallelConfig(**case["parallel"])
    mesh = build_mesh(pcfg, world, world, "cpu")
    dp_rank, dp_size = dp_rank_size(mesh)
    group = dp_group(mesh)
    torch.manual_seed(0)
    lora = LoraConfig(**case["lora"]) if case.get("lora") else None
    model = build_model(ModelConfig(**case.get("model", {})), pcfg, mesh, torch.device("cpu"), seed=0, lora_cfg=lora,
                        compile=case.get("compile", False))
    ocfg = OptimConfig(lr=case.get("lr", 1e-3), warmup_steps=0, schedule="constant", grad_clip=1.0,
                       weight_decay=0.0)
    opt = build_optimizer(model, ocfg, pcfg, group)
    return pcfg, mesh, dp_rank, dp_size, group, model, opt, build_scheduler(opt, ocfg, case["steps"])
