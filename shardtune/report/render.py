"""`shardtune report`'s output: RUN_DIR/plots/*.png drawn and the differences printed, from the run
`load.load_run` reads. Imports no torch; it imports matplotlib (plots.py), so the command imports it
only when a report is drawn."""
from __future__ import annotations

from pathlib import Path

from shardtune.errors import UserError
from shardtune.plan.report import make_console
from shardtune.report.load import load_run
from shardtune.report.plots import (
    memory_title,
    per_device,
    plot_experts,
    plot_loss,
    plot_memory,
    plot_rewards,
    plot_throughput,
)
from shardtune.train.core.eval_lines import eval_lines
from shardtune.verify.compare import MEASURED_KEYS, MEMORY_KEYS, differences, memory_table


def report(run_dir: Path, console=None) -> list[Path]:
    """Draw RUN_DIR/plots/*.png and print the differences; returns the files written."""
    console = console or make_console(140)
    run = load_run(run_dir)
    plots = run_dir / "plots"
    if plots.exists() and not plots.is_dir():
        raise UserError(f"{plots} exists and is not a folder; move it aside so that report can write its plots there")
    plots.mkdir(exist_ok=True)
    sources = {k: run[k] for k in ("predicted", "simulated", "measured") if run[k]}
    written = []
    if sources:
        written.append(plot_memory(sources, plots / "memory.png",
                                   memory_title(sources, run["strategy"], run["measured_method"])))
    for p in (plot_loss(run["records"], plots / "loss.png", run["name"]),
              plot_throughput(run["records"], plots / "throughput.png", run["name"], run["world_size"]),
              plot_rewards(run["records"], plots / "rewards.png", run["name"]),  # dpo and grpo runs
              plot_experts(run["records"], plots / "experts.png", run["name"])):  # MoE runs only
        if p:
            written.append(p)
    rows = []
    for k in ("predicted", "simulated", "measured"):
        if run[k]:
            rows.append((run["strategy"] or "", k, run[k]))
    measured_keys = MEMORY_KEYS if run["measured"] and "buffers" in run["measured"] else tuple(MEASURED_KEYS)
    if run["predicted"] and run["measured"]:
        rows.append(("", "Δ measured vs predicted", differences(run["predicted"], run["measured"], measured_keys)))
    if run["simulated"] and run["measured"]:
        rows.append(("", "Δ measured vs simulated", differences(run["simulated"], run["measured"], measured_keys)))
    if run["predicted"] and run["simulated"]:
        rows.append(("", "Δ simulated vs predicted", differences(run["predicted"], run["simulated"])))
    if rows:
        peak = max(r[2].get("total") or 0 for r in rows if not r[1].startswith("Δ"))
        unit, unit_name = (2**30, "GiB (2^30 bytes)") if peak >= 2**30 else (2**20, "MiB (2^20 bytes)")
        title = f"Memory {per_device(run['measured_method'])}, largest rank, {unit_name}; Δ = relative difference"
        console.print(memory_table(title, rows, unit))
    if run["measured_method"]:
        tracked = "buffers" in (run["measured"] or {})
        how = "; categories from torch's memory tracker over one step's real tensors" if tracked else ""
        console.print(f"measured: {run['measured_method']}{how}")
    if run["simulated"] and run["measured"] and "cuda" not in (run["measured_method"] or ""):
        console.print("note: the simulation follows a CUDA run (foreach AdamW); a CPU run's AdamW loops over "
                      "tensors, so its optimizer-step temporaries are smaller (docs/calibration.md)")
    if run["measured"] and run["measured"].get("total"):  # the same line as the train summary's
        console.print(f"measured peak (largest rank): {run['measured']['total'] / 2**20:,.2f} MiB")
    for note in run["notes"]:
        console.print(f"note: {note}")
    recs = [r for r in run["records"] if r.get("loss") is not None]  # skipped steps carry no loss
    if recs:
        tps = sum(r.get("tokens_per_s", 0) for r in recs) / len(recs)
        console.print(f"loss {recs[0].get('loss', float('nan')):.4f} (step {recs[0].get('step')}) → "
                      f"{recs[-1].get('loss', float('nan')):.4f} (step {recs[-1].get('step')}); "
                      f"{tps:,.0f} tokens/s mean (global: all ranks)")
    for line in eval_lines(run_dir, run["records"]):
        console.print(line, markup=False, highlight=False)
    for p in written:
        console.print(f"wrote {p}")
    return written
