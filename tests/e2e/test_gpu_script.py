"""bench/gpu.sh --dry-run: the GPU check's whole pipeline (recipes, `shardtune plan`, torchrun +
the trainer, collect; the MoE row, bench/gpu_moe.py) on the tiny CPU cut, so that GPU time is spent
only on measuring."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]

# The dry-run cut of Llama-3-8B (bench/gpu_run.py SHAPES): 2 layers, hidden 256, MLP 896,
# 4 query heads and 1 KV head of dim 64, its 128,256-token vocabulary, untied embeddings; seq 64.
V, H, I, L, HEAD_DIM, KV = 128_256, 256, 896, 2, 64, 1
PER_LAYER = 2 * H * H + 2 * H * KV * HEAD_DIM + 3 * H * I + 2 * H  # q, o; k, v; gate, up, down; 2 norms
NUM_PARAMS = 2 * V * H + L * PER_LAYER + H  # embeddings + lm_head, layers, final norm
NUM_TENSORS = L * 9 + 3
# The MoE row's dry-run cut of Qwen3-30B-A3B (bench/gpu_moe.py SHAPES): 2 layers, hidden 128, 8 experts
# of 64 (top-2), 4 query heads and 1 KV head of dim 32 with q/k norms, the 151,936-token vocabulary; seq 64.
MV, MH, ME, MI, MD = 151_936, 128, 8, 64, 32
MOE_LAYER = 2 * MH * 4 * MD + 2 * MH * MD + 2 * MD + ME * MH + 3 * ME * MI * MH + 2 * MH  # attn, norms, router, experts
MOE_PARAMS = 2 * MV * MH + 2 * MOE_LAYER + MH


@pytest.mark.timeout(480)
def test_gpu_script_dry_run(tmp_path):
    assert NUM_PARAMS == 67_372_288
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = run_bounded(["bash", "bench/gpu.sh", "--dry-run", str(out)], timeout_s=450, cwd=REPO,
                       env=env, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for name in ("ac-none", "ac-full", "ac-op", "ac-none-k1"):  # the ratios table
        assert f"\n{name} " in proc.stdout, name
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["mode"] == "dry-run"
    assert result["environment"]["torch"]
    assert set(result["runs"]) == {"ac-none", "ac-full", "ac-op", "ac-none-k1"}
    for name, run in result["runs"].items():
        assert run["ok"], (name, run.get("error"))
        m, p = run["measured"], run["predicted"]
        assert m["steps"] == 3 and [s["step"] for s in m["per_step"]] == [1, 2, 3]
        assert m["tokens_per_s"] > 0 and m["step_time_s"] > 0
        assert m["mfu"] is None  # CPU: no GPU peak FLOP/s
        # the planner: world 1, fp32 on the CPU (the GPU run: bf16-mixed, the same fp32 masters) keeps 4 B/param, fp32
        # grads (4) and Adam m, v (8); zero3 over one rank shards nothing
        assert p["model_params"] == NUM_PARAMS
        mem = p["memory_bytes"]
        assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * NUM_PARAMS, 4 * NUM_PARAMS, 8 * NUM_PARAMS)
        assert p["peak_bytes"] > 16 * NUM_PARAMS
        assert p["tokens_per_s"] > 0 and 0 < p["mfu"] <= 1
        # measured: the exact storage count, plus AdamW's fp32 `step` scalar per tensor
        assert m["states_bytes"] == {"params_bytes": 4 * NUM_PARAMS, "grads_bytes": 4 * NUM_PARAMS,
                                     "optimizer_bytes": 8 * NUM_PARAMS + 4 * NUM_TENSORS}
        assert m["peak_mem_bytes"] >= 16 * NUM_PARAMS
        r = run["ratios_measured_over_predicted"]
        assert abs(r["model_states"] - 1) < 1e-4 and r["tokens_per_s"] > 0 and r["peak_mem"] > 0
        assert run["run_plan_json_peak_bytes"] == p["peak_bytes"], run["run_plan_json_error"]
    # what the ranks ran (memory.json "effective"): the K=1 variant really at 1 chunk (issue 26)
    assert [result["runs"][k]["effective"]["loss_chunks"] for k in ("ac-none", "ac-none-k1")] == [8, 1]
    none, full, op, k1 = (result["runs"][k]["predicted"]["memory_bytes"]["activations"]
                          for k in ("ac-none", "ac-full", "ac-op", "ac-none-k1"))
    assert full < op < none < k1  # k1: AC none with the whole fp32 logits
    ratios = result["step_time_vs_ac_none"]  # each run's step time over AC none's, measured and planned
    base = result["runs"]["ac-none"]
    for name, run in result["runs"].items():
        for side in ("measured", "predicted"):
            want = run[side]["step_time_s"] / base[side]["step_time_s"]
            assert ratios[name][side] == pytest.approx(want, abs=1e-4), (name, side)
    assert ratios["ac-none"] == {"measured": 1.0, "predicted": 1.0}
    assert ratios["ac-full"]["predicted"] >= ratios["ac-op"]["predicted"] >= 1  # this tiny cut: ~equal
    # the MoE row: the Qwen3-MoE cut through the trainer (grouped_mm), its states the planner's, and its
    # experts block timed with grouped_mm and eager (tokens/s and model TFLOP/s recorded for each)
    moe = result["moe"]["trainer_grouped_mm"]
    assert moe["ok"], moe.get("error")
    assert moe["predicted"]["model_params"] == MOE_PARAMS == 39_373_568
    assert moe["measured"]["steps"] == 3 and moe["measured"]["tokens_per_s"] > 0
    assert moe["measured"]["model_tflops"] > 0 and moe["effective"]["experts_implementation"] == "grouped_mm"
    assert abs(moe["ratios_measured_over_predicted"]["model_states"] - 1) < 1e-4
    experts = result["moe"]["experts_grouped_mm_vs_eager"]
    for impl in ("grouped_mm", "eager"):
        assert experts[impl]["tokens_per_s"] > 0 and experts[impl]["model_tflops"] > 0, experts[impl]
    assert experts["grouped_mm_over_eager"] > 0 and "\nmoe " in proc.stdout
