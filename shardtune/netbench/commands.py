"""`shardtune bench comm`: measure collectives, print algbw / busbw, write a profile for `plan`.

Imports no torch at module level (the ranks it starts do).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import typer

MAX_NPROC = 1024  # processes bench comm starts on one machine; more is a typo, not a node

bench_app = typer.Typer(no_args_is_help=True, help="Measure the machine: collectives (bench comm).")


def _fmt_size(n: int) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:g} {unit}"
    return f"{n} B"


def print_table(prof: dict, file=None) -> None:
    """nccl-tests' columns: size, time, algbw, busbw (GB = 10^9 B), then the fitted links."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{prof['backend']} · {prof['world_size']} ranks · {prof['num_nodes']} host(s) · scope "
                    f"{prof['scope']}")
    for col in ("collective", "size", "time (µs)", "algbw (GB/s)", "busbw (GB/s)"):
        t.add_column(col, justify="left" if col == "collective" else "right")
    for r in prof["results"]:
        t.add_row(r["collective"], _fmt_size(r["size_bytes"]), f"{r['time_s'] * 1e6:,.1f}",
                  f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}")
    console = Console(file=file or sys.stdout)
    console.print(t)
    for kind, link in prof["links"].items():
        console.print(f"{kind}: busbw {link['busbw_gbps']:.3f} GB/s, α {link['alpha_s'] * 1e6:.1f} µs per ring step")


def check_output_file(output: str) -> None:
    """`-o` is checked before any rank starts: its folder exists and is writable, and it is no folder."""
    from shardtune.errors import UserError, check_no_blocking_pipe

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


def comm(
    nproc: int = typer.Option(2, "--nproc", help="Processes (ranks) to start on this machine.",
                              metavar="N"),
    sizes: str | None = typer.Option(None, "--sizes", help="Message sizes, binary units: e.g. 4K,1M,64M,256M "
                                                           "(default KiB to 64 MiB on CPU, 512 MiB on GPU).",
                                     metavar="SIZES"),
    output: str | None = typer.Option(None, "-o", "--output", help="Write the profile JSON here (for `shardtune "
                                                                   "plan --network-profile`).", metavar="FILE"),
    as_json: bool = typer.Option(False, "--json", help="Print the profile JSON instead of the table."),
    backend: str = typer.Option("auto", "--backend", metavar="[auto|gloo|nccl]",
                                  help="auto: nccl with CUDA, else gloo."),
    scope: str | None = typer.Option(
        None, "--scope", metavar="[intra|inter]",
        help="Which link of a plan the profile replaces (default: inter if the "
        "ranks ran on several hosts)."),
    timeout: float = typer.Option(600, "--timeout", help="Seconds before every rank is stopped.", metavar="SECONDS"),
) -> None:
    """Time all-gather, reduce-scatter and all-reduce; algbw and busbw as nccl-tests defines them."""
    from shardtune.errors import UserError
    from shardtune.netbench.comm_bench import launch_local, parse_sizes

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
        from shardtune.devices import cuda_available  # lazy: torch-free CLI start-up

        if not cuda_available():
            raise UserError("--backend nccl needs CUDA, and this machine has none; use --backend gloo or auto")
    if output:
        check_output_file(output)
    out = output or os.path.join(tempfile.mkdtemp(prefix="shardtune-comm-"), "profile.json")

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("bench comm"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("starting ranks", total=None)

        def on_progress(done, total, row):
            bar.update(task, completed=done, total=total,
                       description=f"{row['collective']} {_fmt_size(row['size_bytes'])}: {row['busbw_gbps']:.3f} GB/s")

        prof = launch_local(nproc, sizes, out, scope=scope, backend=backend, timeout_s=timeout, on_progress=on_progress)
    if as_json:
        print(json.dumps(prof, indent=2))
    else:
        print_table(prof)
        if output:
            print(f"profile written to {output} (use: shardtune plan ... --network-profile {output})")


def register(app: typer.Typer) -> None:
    bench_app.command("comm")(comm)
    app.add_typer(bench_app, name="bench")
