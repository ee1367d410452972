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
        states = (m["params"] + m["grads"] + m["optimizer"]) / GIB
        assert row[:5] == [f"{states:,.1f}", f"{m['activations'] / GIB:,.1f}", f"{m['buffers'] / GIB:,.1f}",
                           f"{m['optimizer_step_temp'] / GIB:,.1f}", f"{m['total'] / GIB:,.1f}"], s["name"]


def test_wide_shows_every_column_and_columns_is_honoured_when_piped(capsys, monkeypatch):
    wide = _out(capsys, monkeypatch, 80, "--wide")
    assert "peak GB" in wide and "collectives (GB sent each)" in wide and "compute s" in wide
    monkeypatch.delenv("COLUMNS")
    assert main(ARGV) in (0, None)
    piped = capsys.readouterr().out  # no terminal, no COLUMNS: the whole tables, 120 columns
    assert "peak GB" in piped and max(len(ln) for ln in piped.splitlines()) <= 120
    narrow = _out(capsys, monkeypatch, 80)
    assert "peak GB" not in narrow
