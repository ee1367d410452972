"""`shardtune report RUN_DIR`: predicted vs simulated vs measured memory, loss and tokens/s.

Reads the run folder the trainer writes (train/rank/main.py): plan.json (the planner's prediction),
memory.json (measured bytes per rank), metrics.jsonl (per step), and simulated.json when present
(`shardtune plan ... --simulate --json > RUN_DIR/simulated.json`). Writes RUN_DIR/plots/*.png
and prints the differences (report/load.py reads the folder, report/render.py draws and prints).
Imports no torch.
"""
from __future__ import annotations

from pathlib import Path

import typer


def report_cmd(
        run_dir: Path = typer.Argument(..., help="Run folder written by `shardtune train` (runs/<name>)."),
) -> None:
    """Plots (memory by category: predicted / simulated / measured; loss; tokens/s; expert load) into
    RUN_DIR/plots/ and the differences, printed."""
    from shardtune.report.render import report  # matplotlib and verify/ only when a report is drawn

    report(Path(run_dir))


def register(app: typer.Typer) -> None:
    app.command("report")(report_cmd)
