"""What DPO adds to a plan, against hand derivations: the frozen reference copy is the parameter count
× 2 B (bf16) / N per GPU under zero3 (FSDP2 pads each tensor's dim 0 to N: under 0.1 % more), 0 for
LoRA and precompute; a live reference adds one forward to the compute (6N + fwd → 8N: 4/3 of SFT's
compute time without recompute)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardtune.errors import UserError
from shardtune.plan import plan

LLAMA3_70B_PARAMS = 70_553_706_496  # Meta's model card: 70.6B (tied: no; vocab 128,256)


def _zero3(**kw):
    return plan("llama-3-70b", 8, strategies=["zero3"], ac="full", **kw).strategy("zero3")


def test_reference_bytes_are_bf16_params_over_n_and_zero_for_lora_or_precompute():
    sft, dpo = _zero3(), _zero3(objective="dpo")
    ref = dpo.memory.reference
    assert LLAMA3_70B_PARAMS * 2 / 8 <= ref <= LLAMA3_70B_PARAMS * 2 / 8 * 1.001
    assert dpo.memory.total - sft.memory.total == ref and sft.memory.reference == 0
    assert _zero3(objective="dpo", precision="fp32").memory.reference == pytest.approx(2 * ref, rel=1e-9)
    assert _zero3(objective="dpo", lora_rank=16).memory.reference == 0
    assert _zero3(objective="dpo", reference="precompute").memory.reference == 0
    assert plan("llama-3-70b", 16, strategies=["zero3"], objective="dpo").strategy(
        "zero3").memory.reference == pytest.approx(ref / 2, rel=1e-3)


def test_live_reference_adds_one_forward_to_the_compute():
    sft = plan("llama-3-70b", 8, strategies=["zero3"]).strategy("zero3")
    dpo = plan("llama-3-70b", 8, strategies=["zero3"], objective="dpo").strategy("zero3")
    pre = plan("llama-3-70b", 8, strategies=["zero3"], objective="dpo", reference="precompute").strategy("zero3")
    assert dpo.timing["compute_time_s"] / sft.timing["compute_time_s"] == pytest.approx(4 / 3, rel=2e-3)
    assert pre.timing["compute_time_s"] == sft.timing["compute_time_s"]


def test_bad_objective_is_a_user_error():
    with pytest.raises(UserError, match="unknown objective 'ppo'"):
        plan("llama-3-70b", 8, objective="ppo")


def test_plan_json_of_the_dpo_recipe_has_the_reference():
    out = subprocess.run([sys.executable, "-m", "shardtune.cli", "plan", "recipes/smollm2-dpo.yaml", "--gpus", "2",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["inputs"]["objective"] == "dpo"
    z3 = next(s for s in d["strategies"] if s["name"] == "zero3")
    # fp32 recipe: the copy in fp32, half of the 134,515,008 parameters per rank (FSDP2 padding aside)
    assert 134_515_008 * 4 / 2 <= z3["memory"]["reference"] <= 134_515_008 * 4 / 2 * 1.001


def test_offload_all_keeps_the_reference_on_the_host():
    on_gpu, offloaded = _zero3(objective="dpo"), _zero3(objective="dpo", offload="all")
    sft_offloaded = _zero3(offload="all")
    assert offloaded.memory.reference == 0
    assert (offloaded.cpu_offload_bytes_per_node - sft_offloaded.cpu_offload_bytes_per_node
            == on_gpu.memory.reference * 8)  # 8 ranks a node


def test_readme_dpo_table_is_what_the_planner_says():
    """README's "Preference tuning (DPO) of 70B" rows, figure by figure, from the planner now."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    gib = 2**30

    def z3(gpus, **kw):
        return plan("llama-3-70b", gpus, strategies=["zero3"], objective="dpo", ac="full", seq_len=2048,
                    **kw).strategy("zero3")

    def cell(s, first: bool, host: bool = False) -> str:
        if not s.fits:
            return f"{s.memory.total / gib:.1f} GiB: does not fit"
        tps = f"{s.timing['tokens_per_s']:,.0f}"
        if host:
            return (f"{s.memory.total / gib:.1f} GiB + {s.cpu_offload_bytes_per_node / gib:,.0f} GiB"
                    f"{' host RAM a node' if first else ''}, {tps}")
        return f"{s.memory.total / gib:.1f} GiB, {tps}"

    lora8, lora16 = z3(8, lora_rank=16), z3(16, lora_rank=16)
    assert (f"| LoRA r 16 (`--lora-rank 16`) | {lora8.memory.total / gib:.1f} GiB, "
            f"{lora8.timing['tokens_per_s']:,.0f} tokens/s/GPU | {lora16.memory.total / gib:.1f} GiB, "
            f"{lora16.timing['tokens_per_s']:,.0f} |") in readme
    full8, full16 = z3(8), z3(16)
    assert (f"| full, bf16-mixed, live reference ({full8.memory.reference / gib:.1f} / "
            f"{full16.memory.reference / gib:.1f} GiB of it) | {cell(full8, True)} | {cell(full16, False)} |") in readme
    assert f"| {cell(z3(8, precision='bf16'), True)} | {cell(z3(16, precision='bf16'), False)} |" in readme
    pre8, pre16 = z3(8, precision="bf16", reference="precompute"), z3(16, precision="bf16", reference="precompute")
    usable = plan("llama-3-70b", 8).hardware["usable_bytes"] / gib
    assert (f"| {pre8.memory.total / gib:.1f} of {usable:.1f} GiB, {pre8.timing['tokens_per_s']:,.0f} | "
            f"{cell(pre16, False)} |") in readme
    assert f"| {cell(z3(8, offload='all'), True, True)} | {cell(z3(16, offload='all'), False, True)} |" in readme


def test_simpo_holds_no_reference_and_runs_no_reference_forward():
    sft, simpo = _zero3(), _zero3(objective="simpo")
    assert simpo.memory.reference == 0 and simpo.memory.total == sft.memory.total
    assert simpo.timing["compute_time_s"] == sft.timing["compute_time_s"]
