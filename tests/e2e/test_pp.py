"""Pipeline parallelism through `shardtune train` (issue 40): `--pp 2` on 2 processes (1F1B; GPipe with
an uneven `parallel.pp_layers` split, zero2, the chunked loss and bf16-mixed) and pp 2 x dp 2 (zero3,
layer AC) on 4 processes give the losses, gradient norms and validation losses of one process on
the same global batch and precision, 4 steps, within 1e-5 (pure bf16 on 2 processes, pp 2 x tp 2 with
sequence parallelism on 4); memory.json's effective
settings and the start-up line say what ran, and its per-rank states equal the planner's per-stage
states (plan.json); the pp checkpoint resumes on one process and exports.
One launch per configuration (shared runs)."""
from __future__ import annotations

import json

import pytest
from test_effective import RECIPE, _check_effective

pytestmark = [pytest.mark.e2e]

VAL = ["data.val_split=0.01", "train.eval_every=2"]  # val_loss at steps 2 and 4, every run
COMMON = ["train.max_steps=4", "train.grad_accum=2", *VAL]
NO_SAVE = ["checkpoint.save_final=false", "checkpoint.export_hf=false"]
BF16 = "parallel.precision=bf16-mixed"  # 4e-4 from fp32's losses: compared with one process in bf16-mixed
ONE = [*COMMON, "train.micro_batch=4"]  # one process: 4 rows x 2 micro-batches a step (saved, exported)
# levers the one-process reference runs with too: what changes the arithmetic, and validation
SAME_MATH = ("parallel.precision=", "train.loss_chunks=")
RUNS = {  # name → (processes, overrides); every run reads the same 8 rows a step
    "pp2-1f1b-saved": (2, [*ONE, "parallel.pp=2", "checkpoint.every=2"]),  # step_2, step_4, hf_export
    "pp2-gpipe-1+3-zero2-chunks3-bf16": (2, [*ONE, *NO_SAVE, "parallel.pp=2", "parallel.pp_schedule=gpipe",
                                             "parallel.pp_layers=[1,3]", "parallel.strategy=zero2",
                                             "train.loss_chunks=3", BF16]),
    "pp2-bf16": (2, [*ONE, *NO_SAVE, "parallel.pp=2", "parallel.precision=bf16"]),  # pure bf16: bitwise here
    # pp x tp (sequence parallel): each stage's last layer all-gathers the rows it sends
    "pp2-tp2-1f1b-sp": (4, [*ONE, *NO_SAVE, "parallel.pp=2", "parallel.tp=2"]),
    "pp2-dp2-1f1b-ac": (4, [*COMMON, *NO_SAVE, "train.micro_batch=2", "parallel.pp=2",  # AC: the model's layers
                            "parallel.activation_checkpointing=layer", "parallel.ac_every=3"]),  # 0 and 3
}


def _records(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(shared_run):
    """`reference(levers) -> (records, the start-up line's parameter count, run folder)`: one process
    with `levers` (those of a run that change the arithmetic: precision, loss chunks)."""
    def get(levers: tuple = ()):
        out, proc = shared_run(RECIPE.read_text(), *ONE, *([*levers, *NO_SAVE] if levers else []), nproc=1)
        assert proc.returncode == 0, proc.stdout[-3000:]
        return _records(out), _params(proc.stdout), out
    return get


def _params(log: str) -> str:
    """The start-up line's parameter count ("792,576 params")."""
    words = next(x for x in log.splitlines() if " params, global batch" in x).split(" params,")[0].split()
    return words[-1]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(RUNS))
def test_pipeline_equals_one_process(shared_run, reference, name):
    nproc, overrides = RUNS[name]
    reference, params, _ = reference(tuple(o for o in overrides if o.startswith(SAME_MATH)))
    out, proc = shared_run(RECIPE.read_text(), *overrides, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:]
    got = _records(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["target_tokens"] for r in got] == [r["target_tokens"] for r in reference]
    for key in ("loss", "grad_norm", "val_loss"):  # val_loss: at the evaluation steps only
        want = {r["step"]: r[key] for r in reference if key in r}
        assert {r["step"]: r[key] for r in got if key in r} == pytest.approx(want, rel=1e-5, abs=1e-5), key
    assert len(want) == 2, want  # validation ran (steps 2 and 4)
    eff = _check_effective(out, overrides, nproc)  # every TABLE row, parallel.pp* among them
    assert eff["pp"] == 2 and eff["strategy"] == ("zero2" if "zero2" in name else "zero3")
    schedule = "gpipe" if "gpipe" in name else "1f1b"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("shardtune: effective:"))
    assert f"pp 2 ({schedule}, layers {eff['pp_layers']})" in line, line
    tp = 2 if "tp2" in name else 1
    assert f"as pp 2 ({schedule}) x dp {nproc // 2 // tp}" in proc.stdout, proc.stdout[:2000]
    assert (f"x tp {tp} (sequence parallel)" in proc.stdout) == (tp > 1), proc.stdout[:2000]
    assert _params(proc.stdout) == params  # the whole model's (every stage's), as one process counts them
    # the planner's per-stage states (plan.json, the run's own plan) equal each stage's measured bytes
    per_rank = json.loads((out / "memory.json").read_text())["per_rank"]
    planned = next(s for s in json.loads((out / "plan.json").read_text())["strategies"]
                   if s["name"] == eff["strategy"])["stages"]
    size = len(per_rank) // 2  # pp is outermost: stage s is ranks [s·size, (s+1)·size)
    for s, stage in enumerate(planned):
        for key in ("params", "grads", "optimizer"):
            got = max(r[f"{key}_bytes"] for r in per_rank[s * size:(s + 1) * size])
            assert got == stage["memory"][key], (s, key, got, stage["memory"][key])


@pytest.mark.timeout(600)
def test_pp_checkpoint_resumes_on_one_process_and_exports(shared_run, reference, tmp_path):
    """The pp 2 run's step-2 checkpoint (DCP, each stage its own keys) resumed by one process gives the
    one-process run's steps 3 and 4; its export (from the step-4 checkpoint) holds the one-process
    run's trained weights and loads in transformers with its logits."""
    import torch
    from _cli import shardtune_cli
    from transformers import AutoModelForCausalLM

    reference, _, ref_out = reference()
    nproc, overrides = RUNS["pp2-1f1b-saved"]
    out, proc = shared_run(RECIPE.read_text(), *overrides, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:]
    resumed = shardtune_cli("train", RECIPE, "--nproc", "1", "--output-dir", tmp_path / "run", *ONE, *NO_SAVE,
                            f"checkpoint.resume={out / 'checkpoints' / 'step_2'}", timeout_s=300)
    assert resumed.returncode == 0 and "parallel.pp 2 → 1" in resumed.stdout, resumed.stdout[-3000:]
    got = _records(tmp_path / "run")
    assert [r["step"] for r in got] == [3, 4]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in reference[2:]], rel=1e-5, abs=1e-5), key
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, folder in (("pp", out / "hf_export"), ("one", ref_out / "hf_export")):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            logits[name] = model(input_ids=ids).logits
    assert torch.allclose(logits["pp"], logits["one"], atol=1e-5), (logits["pp"] - logits["one"]).abs().max()
