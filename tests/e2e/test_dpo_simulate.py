"""`plan --simulate` traces the DPO step: the simulator's bytes (fake tensors, world 2) against a real
`shardtune train` of the same pairs on 2 gloo processes, whose third step the trainer measures with
torch's trackers into memory.json (train/core/metrics.py `track_this_step`). Expected values come from
the real run; the precompute run's cache file has the planner's size on disk. Then
`plan recipes/smollm2-dpo.yaml --simulate --json --strategy zero3 --gpus 2` reports traced bytes with
the reference copy, equal to the planner's analytic memory.reference (padded FSDP2 shards).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.plan.validate import PlanInputs
from shardtune.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]
SEQ_LEN, MICRO_BATCH = 64, 2
KEYS = ("params", "grads", "optimizer", "activations", "buffers", "optimizer_step_temp", "reference", "total")
# (strategy, precision, reference): a live reference sharded per layer in bf16, and precompute (none held)
CASES = (("zero3", "bf16-mixed", "live"), ("zero2", "fp32", "precompute"))
PAIRS = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a in range(4) for b in range(4)]


def _real(tmp: Path, strategy: str, precision: str, reference: str) -> tuple[list[dict], str]:
    data = tmp / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    (tmp / "r.yaml").write_text(
        f"model: {{name: tiny-llama, init: random}}\n"
        f"data: {{path: {data}, tokenizer: byte, packing: false, shuffle: false, cache_dir: null}}\n"
        f"parallel: {{strategy: {strategy}, precision: {precision}}}\n"
        f"train: {{objective: dpo, reference: {reference}, micro_batch: {MICRO_BATCH}, seq_len: {SEQ_LEN}, "
        "max_steps: 3, log_every: 1}\ncheckpoint: {save_final: false}\n")
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(tmp / "r.yaml"), "--nproc", "2",
           "--output-dir", str(tmp / "run")]
    proc = run_bounded(cmd, timeout_s=400, cwd=REPO, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return json.loads((tmp / "run" / "memory.json").read_text())["per_rank"], proc.stdout


def _largest_reduce_scatter_input_bytes() -> int:
    """fp32 bytes of tiny-llama's largest FSDP group's gradients (as tests/dist/test_simulate_vs_real.py):
    gloo stages a copy of the reduce-scatter input, NCCL (which the fake backend stands for) does not."""
    from shardtune.catalog.models import resolve_model_config

    c = resolve_model_config("tiny-llama")
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    return 4 * max(2 * h * h + 2 * kv * h + 3 * h * i + 2 * h, 2 * v * h + h)


def _check_cache_size(out: str) -> None:
    """The precompute cache the run wrote has the planner's size on disk (plan/preference.py): the
    trainer's line 'reference log-probs of N pairs: PATH' gives N, the file its bytes."""
    from shardtune.plan.preference import reference_cache_bytes

    match = re.search(r"reference log-probs of ([\d,]+) pairs: (\S+)", out)
    assert match, out[-2000:]
    pairs, path = int(match[1].replace(",", "")), Path(match[2])
    assert 0 < pairs <= len(PAIRS)
    assert path.stat().st_size == reference_cache_bytes(pairs), (path.stat().st_size, pairs)
    plan = subprocess.run([sys.executable, "-m", "shardtune.cli", "plan", "tiny-llama", "--objective", "dpo",
                           "--reference", "precompute", "--json"], capture_output=True, text=True, timeout=120)
    assert json.loads(plan.stdout)["disk"]["reference_cache_bytes_per_1k_pairs"] == reference_cache_bytes(1000)


@pytest.mark.timeout(900)  # two 2-rank launches and two traces; a dead rank fails the launch at once
def test_simulated_dpo_step_equals_real_tracked_step(tmp_path):
    from shardtune.verify.simulate import simulate_strategy

    staging = _largest_reduce_scatter_input_bytes()
    failures = []
    for strategy, precision, reference in CASES:
        case = f"{strategy} {precision} {reference}"
        (tmp_path / strategy).mkdir()
        per_rank, out = _real(tmp_path / strategy, strategy, precision, reference)
        real = [r["tracked"] for r in per_rank]
        if reference == "precompute":
            _check_cache_size(out)
        sim = simulate_strategy(PlanInputs("tiny-llama", 2, precision=precision, seq_len=SEQ_LEN,
                                           micro_batch=MICRO_BATCH,
                                           objective="dpo", reference=reference), strategy)
        assert (real[0]["reference"] > 0) == (reference == "live"), (case, real[0])
        for key in KEYS:
            want, got = real[0][key], sim[key]  # rank 0: the rank the simulator plays
            if key in ("buffers", "total") and 0 <= want - got <= staging:
                continue
            if abs(got - want) > max(0.02 * want, 1024):  # the SFT comparison's tolerance
                failures.append(f"{case} {key}: simulated {got:,} vs real {want:,}")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(400)
def test_ddp_live_reference_runs_untracked(tmp_path):
    """ddp's frozen copy is a plain module: torch's MemTracker refused it in the CPU run's tracked third
    step (RuntimeError: cannot register a hook on a tensor that doesn't require gradient, the run
    died). Such a run is now not tracked: it ends, with the trainer's own counts in memory.json."""
    per_rank, _ = _real(tmp_path, "ddp", "fp32", "live")
    assert all("tracked" not in r and r["params_bytes"] > 0 for r in per_rank), per_rank


@pytest.mark.timeout(600)
def test_plan_recipe_simulate_traces_dpo_with_reference(tmp_path, capsys, monkeypatch):
    """`shardtune plan RECIPE --simulate` in this process (cli.main: the same command, no second
    process importing torch again)."""
    from shardtune import cli

    if not (REPO / ".cache/smollm2/SmolLM2-135M-Instruct/config.json").is_file():
        pytest.skip("the SmolLM2 fixture is not built (python -m shardtune.testing.smollm2)")
    monkeypatch.chdir(REPO)
    capsys.readouterr()
    rc = cli.main(["plan", "recipes/smollm2-dpo.yaml", "--simulate", "--json", "--strategy", "zero3", "--gpus", "2"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    plan = json.loads(out.out)
    [sp] = [s for s in plan["strategies"] if s["name"] == "zero3"]
    sim = sp["simulated"]
    assert sim["status"] == "traced", sim
    assert sim["reference"] == sp["memory"]["reference"] > 0, (sim["reference"], sp["memory"]["reference"])
    assert sim["total"] > sim["reference"] + sim["params"] + sim["optimizer"]
