"""`shardtune bench comm`: measure collectives, print algbw / busbw, write a profile for `plan`.

Imports no torch at module level (the ranks it starts do).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import typer

bench_app = typer.Typer(no_args_is_help=True, help="Measure the machine: collectives (bench comm).")


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
    from shardtune.netbench.checks import check_comm_options
    from shardtune.netbench.comm_bench import launch_local
    from shardtune.netbench.table import print_table, progress_line

    check_comm_options(nproc, sizes, output, backend, scope, timeout)
    out = output or os.path.join(tempfile.mkdtemp(prefix="shardtune-comm-"), "profile.json")

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("bench comm"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("starting ranks", total=None)

        def on_progress(done, total, row):
            bar.update(task, completed=done, total=total, description=progress_line(row))

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
