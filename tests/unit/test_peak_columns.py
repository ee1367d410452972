"""The plan's memory columns sum to its peak (issue 42 item 2): `memory.peak_parts` gives the moment
of the peak and what is alive then; the tables print what is not alive in parentheses."""
from __future__ import annotations

import itertools
import json
import re

import pytest

from shardtune.cli import main
from shardtune.plan import memory as M


def _peak_as_documented(st: M.States, act: int, buf: int, grads_in_forward: bool, reduce: int, unsynced: int) -> int:
    """memory.peak_bytes' docstring, written out: the end of forward (grads there only with accumulation
    or DDP), the optimizer step, the end of backward with the root's reduce buffers."""
    at_rest = st.params + st.grads + st.optimizer
    forward = st.params + st.optimizer + act + buf + (st.grads + unsynced if grads_in_forward else 0)
    return max(forward, at_rest + st.optimizer_step_temp, at_rest + reduce)


@pytest.mark.parametrize("gif, reduce, unsynced", list(itertools.product((True, False), (0, 7, 400), (0, 9))))
def test_peak_parts_are_the_documented_peak_and_sum_to_it(gif, reduce, unsynced):
    for st, act, buf in [(M.States(100, 100, 200, 0), 50, 10), (M.States(10, 10, 20, 300), 5, 1),
                         (M.States(100, 100, 200, 0), 0, 0), (M.States(1, 2, 3, 4), 500, 60)]:
        total, phase, parts = M.peak_parts(st, act, buf, gif, reduce, unsynced)
        assert total == _peak_as_documented(st, act, buf, gif, reduce, unsynced) == sum(parts.values())
        assert total == M.peak_bytes(st, act, buf, gif, reduce, unsynced)
        assert phase in ("forward end", "optimizer step", "backward end")


PLANS = [["llama-3-70b", "--gpus", "8"], ["llama-3-8b", "--gpus", "8", "--grad-accum", "4"],
         ["llama-3-8b", "--gpus", "8", "--objective", "dpo"], ["llama-3-8b", "--gpus", "8", "--objective", "grpo"],
         ["qwen3-30b-a3b", "--gpus", "8", "--ep", "8"], ["llama-3-8b", "--gpus", "8", "--offload", "optimizer"],
         ["llama-3-70b", "--gpus", "16", "--nodes", "2", "--pp", "2", "--grad-accum", "2", "--strategy", "zero3"]]


@pytest.mark.parametrize("args", PLANS, ids=[" ".join(a[:1] + a[3:]) for a in PLANS])
def test_every_rows_bare_cells_sum_to_its_peak(args, capsys, monkeypatch):
    assert main(["plan", *args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for s in plan["strategies"]:
        mem, peak = s["memory"], s["peak"]
        assert sum(peak["alive"].values()) == mem["total"], (s["name"], mem, peak)
        assert peak["phase"] in ("forward end", "optimizer step", "backward end", "generation")
    monkeypatch.setenv("COLUMNS", "140")
    assert main(["plan", *args, "--wide"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, x in enumerate(lines) if x.split()[:1] == ["strategy"])
    cols = lines[head].split()
    cols = cols[:cols.index("peak")]  # strategy, the degrees, then the memory columns up to the peak
    if "tmp" in cols:  # "opt tmp" is one column
        cols.remove("tmp")
    rows = 0
    for line in lines[head + 2:]:
        cells = line.split()
        if not cells or cells[0] not in {s["name"] for s in plan["strategies"]}:
            break
        values = cells[2:len(cols)]
        bare = [float(v.replace(",", "")) for v in values if not v.startswith("(")]
        peak = float(cells[len(cols)].replace(",", ""))
        assert sum(bare) == pytest.approx(peak, abs=0.05 * len(bare) + 1e-9), (line, cols)
        assert all(re.fullmatch(r"\([\d,.]+\)|[\d,.]+", v) for v in values), line
        rows += 1
    assert rows == len(plan["strategies"])
