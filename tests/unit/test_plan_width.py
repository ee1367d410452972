"""80 columns (issue 18 item 5): below the wide table's width the plan prints compact tables whose
every line fits and whose cells are whole (the same numbers as --json); --wide forces every column;
COLUMNS is honoured when piped."""
from __future__ import annotations

import json
import re

import pytest

from shardtune.cli import main

GIB = 2**30
ARGV = ["plan", "llama-3-70b", "--gpus", "16", "--nodes", "2", "--tokens", "1e9"]


def _out(capsys, monkeypatch, columns, *extra):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main([*ARGV, *extra]) in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("columns", [80, 100])
def test_compact_tables_fit_and_no_cell_is_cut(columns, capsys, monkeypatch):
    out = _out(capsys, monkeypatch, columns)
    assert max(len(ln) for ln in out.splitlines()) <= columns
    assert "…" not in out
    doc = json.loads(_out(capsys, monkeypatch, columns, "--json"))
    for s in doc["strategies"]:
        m = s["memory"]
        row = re.search(rf"^  {s['name']} +(.*)$", out, re.M).group(1).split()
        alive = s["peak"]["alive"]  # what the peak holds: the rest in parentheses (issue 42: cells sum to it)
        states = sum(m[k] for k in ("params", "grads", "optimizer") if k in alive) / GIB
        cells = [f"{m[k] / GIB:,.1f}" if k in alive or not m[k] else f"({m[k] / GIB:,.1f})"
                 for k in ("activations", "buffers", "optimizer_step_temp")]
        assert row[:5] == [f"{states:,.1f}", *cells, f"{m['total'] / GIB:,.1f}"], s["name"]


def test_wide_shows_every_column_and_columns_is_honoured_when_piped(capsys, monkeypatch):
    wide = _out(capsys, monkeypatch, 80, "--wide")
    assert "peak GB" in wide and "collectives (GB sent each)" in wide and "compute s" in wide
    monkeypatch.delenv("COLUMNS")
    assert main(ARGV) in (0, None)
    piped = capsys.readouterr().out  # no terminal, no COLUMNS: the whole tables, 120 columns
    assert "peak GB" in piped and max(len(ln) for ln in piped.splitlines()) <= 120
    narrow = _out(capsys, monkeypatch, 80)
    assert "peak GB" not in narrow


def _memory_rows():
    """report's rows at their widest: three sources, three Δ rows, a 4-digit peak, a 4-digit Δ."""
    from shardtune.verify.compare import MEMORY_KEYS, differences

    pred = {k: 12.345 * GIB for k in MEMORY_KEYS} | {"total": 1234.56 * GIB}
    meas = {k: 13.1 * GIB for k in MEMORY_KEYS}
    sim = meas | {"optimizer_step_temp": 200.0 * GIB}
    return [("zero3", "predicted", pred), ("", "simulated (12 s)", sim), ("", "measured", meas),
            ("", "Δ measured vs predicted", differences(pred, meas)),
            ("", "Δ measured vs simulated", differences(sim, meas)),
            ("", "Δ simulated vs predicted", differences(pred, sim))]


@pytest.mark.parametrize("columns", [80, 100, 140])
def test_report_and_simulate_memory_table_fit_and_no_cell_is_cut(columns):
    import io

    from rich.console import Console

    from shardtune.verify.compare import memory_table

    buf = io.StringIO()
    Console(width=columns, file=buf, highlight=False).print(memory_table("Memory per GPU, GiB", _memory_rows()))
    out = buf.getvalue()
    assert max(len(ln) for ln in out.splitlines()) <= columns and "…" not in out
    lines = {ln.split()[0] if not ln.lstrip().startswith(("Δ", "zero3")) else " ".join(ln.split()[:2]): ln.split()
             for ln in out.splitlines() if ln.strip()}
    compact = columns < 104  # the whole table is 104 columns wide
    # by hand: 12.345 GiB → "12.3" (compact, one decimal) or "12.35"; peak 1,234.56 → "1,234.6" / "1,234.56";
    # Δ opt tmp simulated vs predicted (200 − 12.345) / 12.345 = +1520.1 % → "+1520%" compact
    pred = lines["zero3 predicted"][2:]
    assert pred == (["12.3"] * 6 + ["1,234.6"] if compact else ["12.35"] * 6 + ["1,234.56"])
    sim_pred = lines["Δ sim/pred" if compact else "Δ simulated"]
    assert sim_pred[-2] == ("+1520%" if compact else "+1520.1%") and sim_pred[-1] == "-98.9%"
    assert ("strategy" in out) is not compact


def test_plan_simulate_table_fits_80_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", "tiny-llama", "--gpus", "2", "--seq-len", "64", "--strategy", "zero3", "--simulate"]) == 0
    out = capsys.readouterr().out
    assert "Δ sim/anal" in out and "…" not in out and max(len(ln) for ln in out.splitlines()) <= 80
