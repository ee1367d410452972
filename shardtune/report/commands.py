"""`shardtune report RUN_DIR`: predicted vs simulated vs measured memory, loss and tokens/s.

Reads the run folder the trainer writes (train/rank/main.py): plan.json (the planner's prediction),
memory.json (measured bytes per rank), metrics.jsonl (per step), and simulated.json when present
(`shardtune plan ... --simulate --json > RUN_DIR/simulated.json`). Writes RUN_DIR/plots/*.png
and prints the differences. Imports no torch; rich, matplotlib and verify/ are imported inside the
command (CLI start-up stays light).
"""
from __future__ import annotations

import json
from pathlib import Path

import typer

from shardtune.errors import UserError, read_json_object


def _read_json(path: Path, what: str) -> dict | None:
    if not path.is_file():
        return None
    return read_json_object(path, what, "re-run the step that writes it")


def _strategy_memory(plan_json: dict | None, strategy: str | None) -> tuple[dict | None, dict | None]:
    """(memory, simulated) of the run's strategy from a plan JSON (plan.json / simulated.json)."""
    if not plan_json or "strategies" not in plan_json:
        return None, None
    entries = plan_json["strategies"]
    s = next((e for e in entries if e["name"] == strategy), entries[0] if len(entries) == 1 else None)
    if s is None:
        return None, None
    sim = s.get("simulated")
    return s.get("memory"), sim if sim and sim.get("status") == "traced" else None


def _run_config(run_dir: Path) -> dict:
    cfg = run_dir / "config.yaml"
    if not cfg.is_file():
        return {}
    import yaml  # inside: CLI start-up imports no yaml

    try:
        config = yaml.safe_load(cfg.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UserError(f"malformed {cfg}: not readable YAML ({str(e).splitlines()[0]}); the file is damaged; "
                        "restore it or remove it (report then names the run by its folder)") from None
    if not isinstance(config, dict) or not isinstance(config.get("parallel") or {}, dict):
        raise UserError(f"malformed {cfg}: not a run config (a mapping with a parallel section); the file is damaged")
    return config


def load_run(run_dir: Path) -> dict:
    """Everything `report` needs from a run folder, as plain data."""
    if not run_dir.is_dir():
        raise UserError(f"run folder {str(run_dir)!r} does not exist; give the folder `shardtune train` wrote "
                        "(runs/<name>)")
    from shardtune.verify.compare import measured_memory

    config = _run_config(run_dir)
    strategy = (config.get("parallel") or {}).get("strategy")
    plan_json = _read_json(run_dir / "plan.json", "plan")
    predicted, sim_in_plan = _strategy_memory(plan_json, strategy)
    _, simulated = _strategy_memory(_read_json(run_dir / "simulated.json", "simulation"), strategy)
    memory_json = _read_json(run_dir / "memory.json", "memory record")
    metrics = run_dir / "metrics.jsonl"
    records, notes = _read_metrics(metrics)
    if predicted is None and memory_json is None and not records:
        raise UserError(f"{str(run_dir)!r} has no plan.json, memory.json or metrics.jsonl; "
                        "give a run folder written by `shardtune train`")
    return {"strategy": strategy, "predicted": predicted, "simulated": simulated or sim_in_plan,
            "measured": measured_memory(memory_json) if memory_json else None,
            "measured_method": (memory_json or {}).get("method"), "records": records, "notes": notes,
            "name": config.get("name") or run_dir.name,
            "world_size": len((memory_json or {}).get("per_rank") or []) or None}


def _read_metrics(path: Path) -> tuple[list[dict], list[str]]:
    """metrics.jsonl's records. A last line cut by a kill is skipped with a note; a bad line
    before it is a UserError (the file is damaged, not merely cut)."""
    if not path.is_file():
        return [], []
    lines = [(i, ln) for i, ln in enumerate(path.read_bytes().decode("utf-8", "replace").splitlines(), 1)
             if ln.strip()]
    records, notes = [], []
    for k, (i, line) in enumerate(lines):
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if k == len(lines) - 1:
                notes.append(f"{path.name} line {i} is incomplete (the run was stopped while writing it); skipped")
                break
            raise UserError(f"malformed {path} line {i}: {e}; the file is damaged") from None
        bad = next((k for k in NUMERIC_KEYS if k in rec and not _number(rec[k], k == "step")), None)
        if bad is not None:
            raise UserError(f"malformed {path} line {i}: {bad!r} is {rec[bad]!r}, not a number; the file is damaged")
        records.append(rec)
    return records, notes


# metrics.jsonl fields the plots read: numbers (or null); the step an integer, and always there
NUMERIC_KEYS = ("step", "loss", "val_loss", "tokens_per_s", "aux_loss", "expert_load_cv")


def _number(v, integer: bool) -> bool:
    if integer:
        return isinstance(v, int) and not isinstance(v, bool)
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def report(run_dir: Path, console=None) -> list[Path]:
    """Draw RUN_DIR/plots/*.png and print the differences; returns the files written."""
    from shardtune.plan.report import make_console
    from shardtune.report.plots import (
        memory_title,
        per_device,
        plot_experts,
        plot_loss,
        plot_memory,
        plot_rewards,
        plot_throughput,
    )
    from shardtune.verify.compare import MEASURED_KEYS, MEMORY_KEYS, differences, memory_table

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
    from shardtune.train.core.eval_lines import eval_lines

    for line in eval_lines(run_dir, run["records"]):
        console.print(line, markup=False, highlight=False)
    for p in written:
        console.print(f"wrote {p}")
    return written


def report_cmd(
        run_dir: Path = typer.Argument(..., help="Run folder written by `shardtune train` (runs/<name>)."),
) -> None:
    """Plots (memory by category: predicted / simulated / measured; loss; tokens/s; expert load) into
    RUN_DIR/plots/ and the differences, printed."""
    report(Path(run_dir))


def register(app: typer.Typer) -> None:
    app.command("report")(report_cmd)
