"""A run folder read for `shardtune report`: plan.json (the planner's prediction), memory.json
(measured bytes per rank), metrics.jsonl (per step), config.yaml and simulated.json when present, as
plain data (`load_run`); a damaged file is one line. Imports no torch."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from shardtune.errors import UserError, read_json_object
from shardtune.verify.compare import measured_memory


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
