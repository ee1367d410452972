"""bench/gpu.sh --dry-run: the GPU check's whole pipeline (recipes, `shardtune plan`, torchrun +
the trainer, collect) on the tiny CPU cut, so that GPU time is spent only on measuring."""
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
# 4 query heads and 1 KV head of dim 64, its 128,256-token vocabulary, untied embeddings.
V, H, I, L, HEAD_DIM, KV = 128_256, 256, 896, 2, 64, 1
PER_LAYER = 2 * H * H + 2 * H * KV * HEAD_DIM + 3 * H * I + 2 * H  # q, o; k, v; gate, up, down; 2 norms
NUM_PARAMS = 2 * V * H + L * PER_LAYER + H  # embeddings + lm_head, layers, final norm
NUM_TENSORS = L * 9 + 3


@pytest.mark.timeout(360)
def test_gpu_script_dry_run(tmp_path):
    assert NUM_PARAMS == 67_372_288
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = run_bounded(["bash", "bench/gpu.sh", "--dry-run", str(out)], timeout_s=330, cwd=REPO,
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
