"""Time all-gather, reduce-scatter and all-reduce like nccl-tests, from torch.distributed.

Run as one rank of a group (torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
    python -m shardtune.netbench.comm_bench --sizes 1M,64M --out profile.json
or let `shardtune bench comm --nproc N` start N local ranks (`launch_local`). The collectives
are the ones FSDP2 issues (`all_gather_single` / `reduce_scatter_single`, formerly
`all_gather_into_tensor` / `reduce_scatter_tensor`), on gloo (CPU) or NCCL (GPU).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from shardtune.errors import UserError
from shardtune.netbench.profile import build_profile, result_row
from shardtune.processes import free_port, kill_groups

DEFAULT_SIZES = "4K,64K,1M,16M,64M"
DEFAULT_SIZES_GPU = "4K,64K,1M,16M,64M,256M,512M"
DEFAULT_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30}


MAX_SIZE_BYTES = 64 * 2**30  # each rank holds a few buffers of it: more is a typo, not a benchmark


def parse_sizes(spec: str) -> list[int]:
    """'4K,1M,64M' → bytes (binary units: K = KiB = 1024 B, as nccl-tests' -b/-e flags)."""
    out = []
    for item in str(spec).split(","):
        s = item.strip().upper()
        if not s:
            continue
        num = s.rstrip("KMGIB")
        unit = s[len(num):]
        try:
            value = float(num) * _UNITS[unit]
        except (ValueError, KeyError):
            raise UserError(f"bad message size {item.strip()!r}; use numbers with K, M or G (binary), e.g. --sizes "
                            "64K,1M,64M") from None
        if not value >= 1:  # NaN too
            raise UserError(f"message size {item.strip()!r} must be at least 1 byte")
        if value > MAX_SIZE_BYTES:  # inf too
            raise UserError(f"message size {item.strip()!r} is above {MAX_SIZE_BYTES // 2**30} GiB; nccl-tests' "
                            "largest default is 128 MiB")
        out.append(int(value))
    if not out:
        raise UserError("no message sizes given; e.g. --sizes 64K,1M,64M")
    return sorted(set(out))


def _collective(dist, kind: str):
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if kind == "all_gather":
        return lambda big, small: ag(big, small)
    if kind == "reduce_scatter":
        return lambda big, small: rs(small, big)
    if kind == "all_reduce":
        return lambda big, small: dist.all_reduce(big)
    raise ValueError(kind)


def run_rank(sizes: list[int], kinds=DEFAULT_KINDS, min_time_s: float = 0.3, max_iters: int = 20,
             progress=None) -> list[dict]:
    """Measure every (kind, size) on this rank's initialised group; returns rows (same on all ranks).

    Time per op is the slowest rank's mean over `iters` back-to-back ops after one warm-up
    (nccl-tests also times back-to-back ops). `iters` is picked from the warm-up so each point
    takes about `min_time_s`, agreed across ranks with a MAX all-reduce.
    """
    import torch  # noqa: PLC0415 the launcher side (launch_local) runs without torch
    import torch.distributed as dist  # noqa: PLC0415 the launcher side (launch_local) runs without torch


    n, cuda = dist.get_world_size(), dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def agreed_max(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    rows, done, total = [], 0, len(kinds) * len(sizes)
    for kind in kinds:
        op = _collective(dist, kind)
        for size in sizes:
            numel = max(n, (size // 4) // n * n)  # float32, divisible by n
            big = torch.ones(numel, dtype=torch.float32, device=device)
            small = torch.ones(numel // n, dtype=torch.float32, device=device)
            dist.barrier()
            t0 = time.perf_counter()
            op(big, small)
            sync()
            warm = agreed_max(time.perf_counter() - t0)
            iters = max(1, min(max_iters, math.ceil(min_time_s / max(warm, 1e-6))))
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                op(big, small)
            sync()
            elapsed = agreed_max((time.perf_counter() - t0) / iters)
            row = result_row(kind, numel * 4, n, elapsed)
            row["iters"] = iters
            rows.append(row)
            del big, small
            done += 1
            if progress:
                progress(done, total, row)
    return rows


def _worker_main(argv: list[str] | None = None) -> int:
    """Entry of one rank: init from torchrun-style env, measure, rank 0 writes the profile."""
    ap = argparse.ArgumentParser(prog="python -m shardtune.netbench.comm_bench")
    ap.add_argument("--sizes", default=None)
    ap.add_argument("--kinds", default=",".join(DEFAULT_KINDS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--scope", choices=["intra", "inter"], default=None)
    ap.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--progress", action="store_true", help="print PROGRESS lines for the launcher")
    a = ap.parse_args(argv)

    import torch  # noqa: PLC0415 the launcher side (launch_local) runs without torch
    import torch.distributed as dist  # noqa: PLC0415 the launcher side (launch_local) runs without torch

    backend = a.backend if a.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    sizes = parse_sizes(a.sizes or (DEFAULT_SIZES_GPU if backend == "nccl" else DEFAULT_SIZES))

    def report(done, total, row):
        if rank == 0 and a.progress:
            print(f"PROGRESS {done} {total} {json.dumps(row)}", flush=True)

    try:
        rows = run_rank(sizes, tuple(a.kinds.split(",")), min_time_s=a.min_time, progress=report)
        names: list = [None] * dist.get_world_size()
        dist.all_gather_object(names, socket.gethostname())
        if rank == 0:
            extra = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if backend == "nccl" else "cpu"}
            prof = build_profile(rows, dist.get_world_size(), backend, names, a.scope, extra)
            Path(a.out).write_text(json.dumps(prof, indent=2))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def launch_local(nproc: int, sizes: str | None, out: str, *, scope: str | None = None,
                 backend: str = "auto", min_time_s: float = 0.3, timeout_s: float = 600,
                 on_progress=None) -> dict:
    """Start `nproc` ranks on this machine (127.0.0.1, a free port), wait, return the profile.

    Children get their own session so a timeout kills every rank (and nothing else); a rank that
    dies makes this raise with its stderr.
    """
    if nproc < 2:
        raise UserError(f"--nproc {nproc}: a collective needs at least 2 processes; use --nproc 2 or more")
    if sizes:
        parse_sizes(sizes)  # fail on bad input before any process starts
    port = free_port()
    args = [sys.executable, "-m", "shardtune.netbench.comm_bench", "--out", out, "--backend", backend,
            "--min-time", str(min_time_s), "--progress"]
    if sizes:
        args += ["--sizes", sizes]
    if scope:
        args += ["--scope", scope]
    procs, logs = [], []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        err = tempfile.TemporaryFile()
        logs.append(err)
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                      stderr=err, text=True, start_new_session=True))
    def read_progress() -> None:  # rank 0's PROGRESS lines, on a thread so a hang cannot block us
        for line in procs[0].stdout:
            if line.startswith("PROGRESS ") and on_progress:
                _, done, total, row = line.split(" ", 3)
                on_progress(int(done), int(total), json.loads(row))

    reader = threading.Thread(target=read_progress, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):  # a dead rank leaves the others hanging
                break
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(0.05)
    except TimeoutError:
        kill_groups(procs)
        raise UserError(f"bench comm timed out after {timeout_s:.0f} s; try fewer or smaller --sizes") from None
    except BaseException:
        kill_groups(procs)
        raise
    kill_groups(procs)
    reader.join(timeout=5)
    bad = sorted(((r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0),
                 key=lambda rc: rc[1] < 0)  # the rank that failed first, not the ones we killed
    if bad:
        r, code = bad[0]
        logs[r].seek(0)
        tail = logs[r].read().decode(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"bench comm rank {r} exited with {code}: " + " | ".join(tail))
    return json.loads(Path(out).read_text())


if __name__ == "__main__":
    sys.exit(_worker_main())
