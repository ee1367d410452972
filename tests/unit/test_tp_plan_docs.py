"""docs/parallelism.md's planner figures (and the README's TP rows' prose) are what `shardtune
plan` prints: each quoted command re-planned (the `# fits:` lines: tests/unit/test_docs_figures.py)."""
import json
import re
import shlex
from pathlib import Path

from shardtune.cli import main

GIB = 2**30
REPO = Path(__file__).resolve().parents[2]


def _run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_parallelism_md_figures_are_what_plan_prints(capsys):
    """docs/parallelism.md's cost table and the 256-GPU comparison, re-planned from the commands
    the page shows (its `# fits:` lines are checked by test_docs_figures.py)."""
    doc = (REPO / "docs" / "parallelism.md").read_text()
    base = re.search(r"The planner's step for the same plan \(`shardtune plan (.+?)` and the flags", _flat(doc))
    rows = re.findall(r"^\| [^|]+ \| (\(none\)|`[^`]+`) \| ([\d.]+) \| ([\d.]+) \| ([\d,]+) \|$", doc, re.M)
    assert base and len(rows) == 4
    for flags, step, exposed, tps in rows:
        extra = [] if flags == "(none)" else shlex.split(flags.strip("`"))
        s = plan_json(capsys, *shlex.split(base.group(1)), *extra)["strategies"][0]
        assert (f"{s['step_time_s']:.3g}", f"{s['exposed_comm_s']:.3g}", f"{s['tokens_per_s']:,.0f}") == (
            step, exposed, tps), flags
    tt = re.search(r"planner gives ([\d.]+) GiB and ([\d,]+) tokens/s per GPU at bf16 \(`shardtune plan (.+?)`",
                   _flat(doc))
    s = plan_json(capsys, *shlex.split(tt.group(3)))["strategies"][0]
    assert (f"{s['memory']['total'] / GIB:.1f}", f"{s['tokens_per_s']:,.0f}") == tt.group(1, 2)
    alone = re.search(r"zero3 alone also fits \(([\d.]+) GiB at micro-batch 2.*?planned faster \(([\d,]+) tokens/s\)",
                      _flat(doc))
    args = shlex.split(tt.group(3).replace("--tp 8 ", "").replace("--micro-batch 16", "--micro-batch 2"))
    s = plan_json(capsys, *args)["strategies"][0]
    assert (f"{s['memory']['total'] / GIB:.1f}", f"{s['tokens_per_s']:,.0f}") == alone.group(1, 2)


def plan_json(capsys, *args):
    rc, out, err = _run(["plan", *args, "--json"], capsys)
    assert rc == 0, err
    return json.loads(out)


def test_readme_tp_prose_is_what_plan_prints(capsys):
    # the README's TP paragraph: 405B fits nothing without TP, zero3 with --tp 8; and the planner
    # at torchtitan's 70B setting (the recipe rows themselves: tests/unit/test_readme_figures.py)
    readme = _flat((REPO / "README.md").read_text())
    m = re.search(r"`(shardtune plan llama-3\.1-405b [^`]+)` fits nothing \(zero3: ([\d.]+) GiB of ([\d.]+)\); "
                  r"with `(--tp 8)` zero3 needs ([\d.]+) GiB", readme)
    assert m, "the README's TP paragraph moved: update this test"
    d = plan_json(capsys, *shlex.split(m.group(1))[2:])
    assert not any(s["fits"] for s in d["strategies"])
    z3 = next(s for s in d["strategies"] if s["name"] == "zero3")
    assert (f"{z3['memory']['total'] / GIB:.1f}", f"{d['hardware']['usable_bytes'] / GIB:.1f}") == m.group(2, 3)
    d = plan_json(capsys, *shlex.split(m.group(1))[2:], "--tp", "8")
    z3 = next(s for s in d["strategies"] if s["name"] == "zero3")
    assert z3["fits"] and f"{z3['memory']['total'] / GIB:.1f}" == m.group(5)
    t = re.search(r"torchtitan's 70B setting \(`(shardtune plan [^`]+)`, bf16, no Float8\): ([\d.]+) GiB and "
                  r"([\d,]+) tokens/s", readme)
    s = plan_json(capsys, *shlex.split(t.group(1))[2:])["strategies"][0]
    assert (f"{s['memory']['total'] / GIB:.1f}", f"{s['tokens_per_s']:,.0f}") == t.group(2, 3)
