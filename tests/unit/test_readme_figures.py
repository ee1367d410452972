"""The README's planner figures are what the planner prints today (issue 18 item 4): each quoted
command is run again (in-process, the real CLI) and the README's text compared with its output.

Covered: the tour's `shardtune plan llama-3-70b --gpus 8 --gpu h100-80gb` console block (every
line shown, in order; the elided communication/time tables excepted), the four 70B recipes'
rows (peak, host RAM, tokens/s/GPU and MFU, global batch from `plan RECIPE --gpus 8 --json`; the
QLoRA one on 2 GPUs), the prose that repeats them (LoRA peak, pure bf16's spare GiB), the
blog-table arithmetic (16 B per parameter of the catalogue's Ψ over 8 GPUs), the ZeRO Figure 1
comment of the plan examples, and the levers' QLoRA verdict and chunked-loss peaks.
Not covered: "pure bf16: 56.9 GiB" for 8-bit AdamW (no quoted command gives it).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardtune.cli import main
from shardtune.config import load_recipe

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
GIB = 2**30


def _run(capsys, *args: str) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


def _plan_json(capsys, *args: str) -> dict:
    return json.loads(_run(capsys, "plan", *args, "--json"))


def test_tour_plan_block_is_what_the_cli_prints(capsys, monkeypatch):
    block = re.search(r"```console\n\$ (shardtune plan llama-3-70b --gpus 8 --gpu h100-80gb)\n(.*?)```", README, re.S)
    assert block, "the tour's plan block moved: update this test"
    monkeypatch.setenv("COLUMNS", "120")  # the width the README's table was printed at (piped default)
    out = [line.rstrip() for line in _run(capsys, *block.group(1).split()[1:]).splitlines()]
    shown = [line.rstrip() for line in block.group(2).splitlines() if not line.startswith("...")]
    at = 0
    for line in shown:  # every README line appears in the output, in the same order
        assert line in out[at:], f"README line not printed (or out of order): {line!r}"
        at = out.index(line, at) + 1


def _recipe_rows() -> dict[str, list[str]]:
    rows = re.findall(r"^\| \[`([\w.-]+)`\]\(recipes/\1\.yaml\) \|(.*)\|$", README, re.M)
    return {name: [c.strip() for c in cells.split("|")] for name, cells in rows}


@pytest.fixture(scope="module")
def recipe_plans():
    rows = _recipe_rows()
    assert set(rows) == set(RECIPE_GPUS)
    return rows


RECIPE_GPUS = {"llama-3-70b-lora-8xh100": 8, "llama-3-70b-8xh100": 8, "llama-3-70b-bf16-8xh100": 8,
               "llama-3-70b-qlora-2x4090": 2, "llama-3.1-405b-tp8-16x8xh100": 128, "llama-3-70b-tp8-2x8xh100": 16,
               "llama-3.1-8b-128k-cp8-8xh100": 8, "llama-3.1-70b-32k-64xh100": 64,
               "qwen3-30b-a3b-ep8-8xh100": 8, "mixtral-8x7b-lora-8xh100": 8, "qwen3-235b-a22b-lora-2x8xh100": 16}


@pytest.mark.parametrize("name", list(RECIPE_GPUS))
def test_70b_recipe_row_is_what_plan_recipe_prints(recipe_plans, capsys, name):
    recipe = REPO / "recipes" / f"{name}.yaml"
    d = _plan_json(capsys, str(recipe), "--gpus", str(RECIPE_GPUS[name]))
    s = next(x for x in d["strategies"] if x["name"] == load_recipe(recipe).parallel.strategy)
    _, peak, host, speed, batch = recipe_plans[name]
    assert s["fits"]
    assert peak.split(" of ")[0] == f"{s['memory']['total'] / GIB:.1f} GiB"
    if " of " in peak:
        assert peak.split(" of ")[1] == f"{d['hardware']['usable_bytes'] / GIB:.1f}"
    cpu = s["cpu_offload_bytes_per_node"]
    assert host == (f"{cpu / GIB:,.0f} GiB" if cpu else "—")
    assert speed == f"{s['tokens_per_s']:,.0f} ({s['mfu'] * 100:.0f} %)"
    inp = d["inputs"]
    dp = inp["gpus"] // inp.get("tp", 1) // inp.get("cp", 1)  # a tensor- or context-parallel group shares its batch
    assert batch == f"{inp['micro_batch'] * inp['grad_accum'] * dp} × {inp['seq_len']:,}"


def test_prose_repeats_the_recipes_figures(recipe_plans, capsys):
    lora = recipe_plans["llama-3-70b-lora-8xh100"][1]
    assert f"(our LoRA plan: {lora})" in README
    d = _plan_json(capsys, str(REPO / "recipes" / "llama-3-70b-bf16-8xh100.yaml"), "--gpus", "8")
    spare = next(x for x in d["strategies"] if x["name"] == "zero3")["headroom_bytes"] / GIB
    assert f"Pure\nbf16 is tight ({spare:.1f} GiB spare" in README


def test_blog_table_arithmetic_uses_the_catalogues_parameter_count(capsys):
    n = _plan_json(capsys, "llama-3-70b", "--gpus", "8")["model"]["params"]
    per_gpu = 16 * n / 8
    assert f"16 × {n / 1e9:.2f} × 10^9 / 8 =\n{per_gpu / 1e9:.0f} GB ({per_gpu / GIB:.1f} GiB) per GPU" in README


def test_zero_figure_1_comment_is_what_plan_prints(capsys):
    line = re.search(r"^(shardtune plan --params 7\.5e9 --gpus 64 --accounting paper) +# .*?: ([\d./ ]+) GB$",
                     README, re.M)
    assert line
    d = _plan_json(capsys, *line.group(1).split()[2:])
    states = {s["name"]: sum(s["memory"][k] for k in ("params", "grads", "optimizer")) / 1e9 for s in d["strategies"]}
    quoted = line.group(2).split(" / ")
    for strategy, text in zip(("ddp", "zero1", "zero2", "zero3"), quoted, strict=True):
        decimals = len(text.partition(".")[2])  # as many as the README shows
        assert f"{states[strategy]:.{decimals}f}" == text, strategy


def test_levers_figures_are_what_plan_prints(capsys):
    """The QLoRA no-offload verdict and the chunked loss's effect on the 8B recipe, as quoted."""
    flat = " ".join(README.split())
    qlora = re.search(r"\(`(shardtune plan llama-3-70b [^`]*--quantize-base nf4 --ac full)`: ([\d.]+) GiB of ([\d.]+), "
                      r"no fit\)", flat)
    assert qlora, "the QLoRA lever's figure moved: update this test"
    d = _plan_json(capsys, *qlora.group(1).split()[2:])
    s = d["strategies"][0]
    assert not s["fits"]
    assert (f"{s['memory']['total'] / GIB:.1f}", f"{d['hardware']['usable_bytes'] / GIB:.1f}") == qlora.groups()[1:]
    chunks = re.search(r"peak falls from ([\d.]+) GiB \(`(shardtune plan recipes/llama-3-8b-8xh100\.yaml --gpus 8) "
                       r"--loss-chunks 1`\) to ([\d.]+) GiB per GPU", flat)
    assert chunks, "the chunked-loss lever's figure moved: update this test"
    args = chunks.group(2).split()[2:]
    peaks = [next(x for x in _plan_json(capsys, *args, *extra)["strategies"] if x["name"] == "zero3")["memory"]["total"]
             for extra in (["--loss-chunks", "1"], [])]
    assert [f"{b / GIB:.1f}" for b in peaks] == [chunks.group(1), chunks.group(3)]


def test_moe_plan_figures(capsys):
    """The MoE paragraph's `shardtune plan qwen3-30b-a3b --gpus 8`: total and active parameters, zero3's peak."""
    out = _run(capsys, "plan", "qwen3-30b-a3b", "--gpus", "8")
    line = out.splitlines()[0]
    assert line.startswith("model qwen3-30b-a3b: ") and line.split(": ", 1)[1] in README, line
    zero3 = next(x for x in _plan_json(capsys, "qwen3-30b-a3b", "--gpus", "8")["strategies"] if x["name"] == "zero3")
    assert f"zero3 fits at {zero3['memory']['total'] / GIB:.1f} GiB" in " ".join(README.split()), zero3["memory"]
    assert zero3["fits"]


def test_moe_ep_plan_figures(capsys):
    """The MoE paragraph's `shardtune plan qwen3-30b-a3b --gpus 8 --ep 8`: zero3's peak and tokens/s with
    and without ep, the all-to-all bytes a rank sends per step."""
    text = " ".join(README.split())
    ep, no_ep = (next(x for x in _plan_json(capsys, "qwen3-30b-a3b", "--gpus", "8", *extra)["strategies"]
                      if x["name"] == "zero3") for extra in (["--ep", "8"], []))
    assert f"--ep 8`: zero3 fits at {ep['memory']['total'] / GIB:.1f} GiB" in text, ep["memory"]
    assert f"predicts {ep['tokens_per_s']:,.0f} tokens/s per GPU against {no_ep['tokens_per_s']:,.0f} without ep" \
        in text
    a2a = ep["comm"]["all_to_all"]["bytes_per_rank_per_micro_batch"]  # grad_accum 1: one micro-batch a step
    assert f"all-to-all of {a2a / 1e9:.1f} GB a rank per step" in text, a2a


def test_moe_recipe_tflops_beside_the_published_figure(recipe_plans, capsys):
    """The Qwen3 ep-8 recipe's TFLOP/s a GPU (the planner's MFU × the GPU's bf16 peak) as quoted beside
    NeMo AutoModel's published row, which stays a quote (not computed here) marked not measured by us."""
    d = _plan_json(capsys, str(REPO / "recipes" / "qwen3-30b-a3b-ep8-8xh100.yaml"), "--gpus", "8")
    s = next(x for x in d["strategies"] if x["name"] == "zero3")
    assert d["inputs"]["ep"] == 8 and s["fits"]
    bf16 = d["hardware"]["bf16_flops"]
    text = " ".join(README.split())
    assert (f"The planner's Qwen3 row is {s['mfu'] * bf16 / 1e12:.0f} TFLOP/s a GPU (its MFU × the H100's "
            f"{bf16 / 1e12:.1f} bf16 TFLOP/s)") in text
    assert "| NeMo AutoModel, published (issue 39's quote of its docs; not measured by us) | Qwen3-30B-A3B, " \
           "EP 8 × FSDP 8, bf16, 8 H100 | — | — | 277 TFLOP/s/GPU (28 %) | — |" in README


def test_qwen3_235b_lora_tflops_beside_the_published_figure(capsys):
    """The 235B LoRA recipe's TFLOP/s a GPU as the README quotes it, beside Megatron-Bridge's published
    H100 row (a quote with its source commit, not computed here)."""
    d = _plan_json(capsys, str(REPO / "recipes" / "qwen3-235b-a22b-lora-2x8xh100.yaml"), "--gpus", "16")
    s = next(x for x in d["strategies"] if x["name"] == "zero3")
    assert d["inputs"]["lora_rank"] == 16 and d["inputs"].get("ep", 1) == 1 and s["fits"]
    text = " ".join(README.split())
    assert f"The 235B LoRA row is {s['mfu'] * d['hardware']['bf16_flops'] / 1e12:.0f} TFLOP/s a GPU" in text
    assert ("Megatron-Bridge/blob/00b7660be0254ac6f95f44164ddd0c3e9cc798ed/docs/performance-summary.md), 25.11 "
            "container, DGX-H100; not measured by us) | Qwen3-235B-A22B pre-training, FP8-CS, TP 2 × PP 8 × EP 32, "
            "256 H100 | — | — | 1,575 tokens/s/GPU, 233 model TFLOP/s/GPU | — |") in README


def test_moe_md_recipe_figures_are_what_plan_recipe_prints(capsys):
    """docs/moe.md's "Recipes" section repeats both MoE recipes' plans: peak, tokens/s, MFU, TFLOP/s."""
    moe = " ".join((REPO / "docs" / "moe.md").read_text().split("## Recipes", 1)[1].split())
    for name, fmt in (("qwen3-30b-a3b-ep8-8xh100", "fits at {peak} GiB of {usable}, {tps} tokens/s per GPU, "
                                                   "MFU {mfu} % ({tflops} TFLOP/s a GPU)"),
                      ("mixtral-8x7b-lora-8xh100", "Fits at {peak} GiB, {tps} tokens/s per GPU ({mfu} %)")):
        d = _plan_json(capsys, str(REPO / "recipes" / f"{name}.yaml"), "--gpus", "8")
        s = next(x for x in d["strategies"] if x["name"] == "zero3")
        want = fmt.format(peak=f"{s['memory']['total'] / GIB:.1f}", usable=f"{d['hardware']['usable_bytes'] / GIB:.1f}",
                          tps=f"{s['tokens_per_s']:,.0f}", mfu=f"{s['mfu'] * 100:.0f}",
                          tflops=f"{s['mfu'] * d['hardware']['bf16_flops'] / 1e12:.0f}")
        assert s["fits"] and want in moe, (name, want)
