"""`shardtune bench comm`'s options checked before any rank starts: one line each, exit 2. Imports no torch."""
from __future__ import annotations

import os
from pathlib import Path

from shardtune.errors import UserError, check_no_blocking_pipe
from shardtune.netbench.comm_bench import parse_sizes

MAX_NPROC = 1024  # processes bench comm starts on one machine; more is a typo, not a node


def check_comm_options(nproc: int, sizes: str | None, output: str | None, backend: str, scope: str | None,
                       timeout: float) -> None:
    """Backend, scope, sizes, process count, timeout, CUDA for nccl and the -o file."""
    if backend not in ("auto", "gloo", "nccl"):
        raise UserError(f"unknown backend {backend!r}; choose auto, gloo or nccl")
    if scope not in (None, "intra", "inter"):
        raise UserError(f"unknown scope {scope!r}; choose intra or inter")
    if sizes:
        parse_sizes(sizes)
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: give at least 1 process")
    if nproc > MAX_NPROC:
        raise UserError(f"--nproc {nproc}: give at most {MAX_NPROC} processes on one machine")
    if not 0 < timeout < float("inf"):  # NaN fails this too
        raise UserError(f"--timeout {timeout}: give a positive, finite number of seconds")
    if backend == "nccl":
        from shardtune.devices import cuda_available  # noqa: PLC0415 it may import torch: only for nccl

        if not cuda_available():
            raise UserError("--backend nccl needs CUDA, and this machine has none; use --backend gloo or auto")
    if output:
        check_output_file(output)


def check_output_file(output: str) -> None:
    """`-o` is checked before any rank starts: its folder exists and is writable, and it is no folder."""
    path = Path(output).expanduser()
    check_no_blocking_pipe(path, "-o")
    if path.is_symlink() and not path.exists():
        raise UserError(f"-o {output!r} is a link to nothing (dangling, or a loop); give a file path")
    if path.is_dir():
        raise UserError(f"-o {output!r} is a folder; give a file path such as {os.path.join(output, 'profile.json')}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"-o {output!r}: folder {str(parent)!r} does not exist; create it or give another path")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"-o {output!r} cannot be written (permission denied); give another path")
