"""The pipeline figures of the README and docs/parallelism.md are what `shardtune plan ... --fit`
prints today (issue 40 item 6): each quoted search is run again through the CLI (`--json`) and the
text compared with it."""
from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest

from shardtune.cli import main

REPO = Path(__file__).resolve().parents[2]
README = " ".join((REPO / "README.md").read_text().split())
DOC = " ".join((REPO / "docs" / "parallelism.md").read_text().split())
CLUSTERS = {("llama-3.1-405b", "eth-100g"): ("64", "8"), ("llama-3.1-405b", "ib-ndr-400"): ("64", "8"),
            ("llama-3-70b", "eth-100g"): ("16", "2"), ("llama-3-70b", "ib-ndr-400"): ("16", "2")}


@cache
def _fit(model: str, link: str) -> dict:
    import contextlib
    import io

    gpus, nodes = CLUSTERS[model, link]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", model, "--gpus", gpus, "--nodes", nodes, "--interconnect", link, "--fit", "--json"]) == 0
    return json.loads(out.getvalue())["pipeline_gain"]


def test_readme_faq_row_is_what_fit_prints():
    g = _fit("llama-3.1-405b", "eth-100g")
    assert g["pipeline"].startswith("zero3 × pp 8 × tp 8") and g["speedup"] > 1
    row = (f"| zero3 × pp 8 × tp 8, 1F1B, 64 micro-batches | {g['pipeline_tokens_per_s']:,.0f} | "
           f"{g['speedup']:.2f}× (zero3 × tp 8: {g['without_tokens_per_s']:.1f}) |")
    assert row in README and g["without"].startswith("zero3 × tp 8,") and "grad-accum 64" in g["pipeline"]


@pytest.mark.parametrize("model,link", list(CLUSTERS))
def test_parallelism_md_table_is_what_fit_prints(model, link):
    g = _fit(model, link)
    row = re.search(rf"\| {re.escape(model)}, [^|]*\| {re.escape(link)} \|([^|]*)\|([^|]*)\|([^|]*)\|", DOC)
    assert row, (model, link)
    pipe, flat, ratio = (c.strip() for c in row.groups())
    assert pipe.startswith(" × ".join(g["pipeline"].split(", ")[0].split(" × ")[:3]).split(" × AC")[0])
    assert pipe.endswith(f": {g['pipeline_tokens_per_s']:g}") or pipe.endswith(f": {g['pipeline_tokens_per_s']:.0f}")
    assert flat.startswith(g["without"].split(", ")[0]) and flat.endswith(f": {g['without_tokens_per_s']:g}")
    assert ratio == f"{g['speedup']:.2f}×"
    if model == "llama-3.1-405b" and link == "ib-ndr-400":
        assert f"{g['speedup']:.2f}× for 405B" in README
    if model == "llama-3-70b":
        assert (f"{g['speedup']:.2f}× for 70B" if link == "ib-ndr-400" else f"gains {g['speedup']:.2f}×") in README
