"""`shardtune train recipes/tiny-moe-cpu.yaml` as a user runs it: a tiny Mixtral (4 experts, top-2,
grouped-GEMM experts, fp32 router) under zero3, zero2 with AC full, hsdp, and zero3 with expert
parallelism (`--ep 2`: 2 experts a rank, tokens sent by all-to-all) on 2 processes, ep 2 x
expert-FSDP 2 on 4 processes (2 rows each, the same global batch), ep 2 x cp 2 on 2 processes and
ep 2 x tp 2 (sequence parallel) on 4, each giving one
process's losses over 4 fp32 steps (same 8-row global batch), its load-balancing loss (`aux_loss`)
and its expert load (`expert_load_cv`) included. The ep runs save checkpoints (each rank's experts as
rows of the whole [E, ...] tensor): resumed at ep 2 and at ep 1 they continue one process's losses,
their optimizer states are one process's, and their exports load in transformers with one process's
logits. The runs are made once for the module."""
from __future__ import annotations

from pathlib import Path

import pytest
from _cli import REPO, metrics, shardtune_cli

pytestmark = [pytest.mark.e2e]
RECIPE = REPO / "recipes" / "tiny-moe-cpu.yaml"
SAVE = ["checkpoint.every=2", "checkpoint.save_final=true"]
RUNS = {
    "one": ["--nproc", "1", "train.micro_batch=8", *SAVE, "checkpoint.export_hf=true"],
    "zero3": ["--nproc", "2"],
    "zero2_ac": ["--nproc", "2", "--strategy", "zero2", "parallel.activation_checkpointing=full"],
    "hsdp": ["--nproc", "2", "--strategy", "hsdp", "parallel.hsdp_shard_size=1"],
    "ep2": ["--nproc", "2", "--ep", "2", *SAVE, "checkpoint.export_hf=true"],
    # ep 2 x expert-FSDP 2: each expert's states on 2 ranks, its gradient summed on the wire then divided
    "ep2_efsdp2": ["--nproc", "4", "--ep", "2", "train.micro_batch=2", *SAVE],
    # ep x cp: the ep group is the cp pair (each rank half of every row), 8 rows on the one data rank
    "ep2_cp2": ["--nproc", "2", "--ep", "2", "--cp", "2", "train.micro_batch=8"],
    # ep x tp (+ SP): each tp rank routes its sequence half; the experts are tp replicas (not split).
    # Adam's eps 1e-3 (and one process's at the same eps): with 1e-8, fp32 noise of tp's split matmuls on
    # near-zero gradient elements becomes full-size Adam steps that flip a near-tie routing (docs/moe.md)
    "one_eps": ["--nproc", "1", "train.micro_batch=8", "optim.eps=1e-3"],
    "ep2_tp2": ["--nproc", "4", "--ep", "2", "--tp", "2", "optim.eps=1e-3"],
    # step 2's checkpoints read back at another layout: ep 2 (saved at ep 2), ep 1 (saved at ep 2 x efsdp 2)
    "ep2_resumed": ["--nproc", "2", "--ep", "2", "--resume", "{tmp}/ep2/checkpoints/step_2"],
    "ep1_resumed": ["--nproc", "2", "--resume", "{tmp}/ep2_efsdp2/checkpoints/step_2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[dict], str]]:
    tmp: Path = tmp_path_factory.mktemp("moe")
    out = {}
    for name, args in RUNS.items():
        args = [a.format(tmp=tmp) for a in args]
        proc = shardtune_cli("train", RECIPE, "--output-dir", tmp / name, *args, timeout_s=240)
        assert proc.returncode == 0, proc.stdout[-3000:]
        out[name] = (metrics(tmp / name), proc.stdout)
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["zero3", "zero2_ac", "hsdp", "ep2", "ep2_efsdp2", "ep2_cp2", "ep2_tp2"])
def test_two_processes_give_one_process_losses_aux_loss_and_load(runs, layout):
    one, _ = runs["one_eps" if layout == "ep2_tp2" else "one"]
    got, _ = runs[layout]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for key in ("loss", "aux_loss", "expert_load_cv", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in one], abs=1e-5), key


@pytest.mark.timeout(900)
def test_the_moe_run_learns_and_logs_its_terms(runs):
    one, log = runs["one"]
    assert one[-1]["loss"] < one[0]["loss"] - 0.5
    # aux = E · Σ f·P: 1 when the router is uniform and balanced, up to E; near 2 from a random init
    assert all(1.0 <= r["aux_loss"] <= 4.0 for r in one)
    assert all(r["expert_load_cv"] > 0 for r in one)  # top-2 of 4 random routers is never exactly even
    assert "experts grouped_mm" in log


@pytest.mark.timeout(900)
def test_ep_says_what_it_ran(runs, tmp_path_factory):
    """memory.json's `effective` and the start-up line: ep 2, each expert's states on one rank (expert
    FSDP degree 2 ranks / ep 2); without --ep, ep 1 and the experts sharded over both ranks."""
    import json

    _, log = runs["ep2"]
    assert "experts grouped_mm (4 per layer, top-2, ep 2, expert_fsdp 1)" in log
    base = tmp_path_factory.getbasetemp()
    eff = {n: json.loads(next(base.glob(f"moe*/{n}/memory.json")).read_text())["effective"]
           for n in ("ep2", "zero3", "ep2_efsdp2")}
    assert (eff["ep2"]["ep"], eff["ep2"]["expert_fsdp"]) == (2, 1)
    assert (eff["ep2_efsdp2"]["ep"], eff["ep2_efsdp2"]["expert_fsdp"]) == (2, 2)
    assert (eff["zero3"]["ep"], eff["zero3"]["expert_fsdp"]) == (1, 2)
    for name, want in (("ep2_cp2", "cp 2, experts grouped_mm (4 per layer, top-2, ep 2, expert_fsdp 1)"),
                       ("ep2_tp2", "tp 2 + SP, experts grouped_mm (4 per layer, top-2, ep 2, expert_fsdp 1)")):
        assert want in runs[name][1], name
    got = {n: json.loads(next(base.glob(f"moe*/{n}/memory.json")).read_text())["effective"]
           for n in ("ep2_cp2", "ep2_tp2")}
    assert [(e["ep"], e["tp"], e["cp"], e["expert_fsdp"]) for e in got.values()] == [(2, 1, 2, 1), (2, 2, 1, 1)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["ep2", "ep2_efsdp2", "ep2_cp2", "ep2_tp2"])
def test_ep_states_per_rank_equal_the_planners(runs, tmp_path_factory, name):
    """Each rank's parameter, gradient and optimizer bytes (the trainer's storage count, memory.json)
    equal plan.json's (plan/ep.py: experts E/ep rows over expert-FSDP ranks, the rest over all)."""
    import json

    run = next(tmp_path_factory.getbasetemp().glob(f"moe*/{name}"))
    planned = json.loads((run / "plan.json").read_text())["strategies"][0]
    assert planned["layout"]["ep"] == 2
    for rank in json.loads((run / "memory.json").read_text())["per_rank"]:
        for key in ("params", "grads", "optimizer"):
            assert rank[f"{key}_bytes"] == planned["memory"][key], key


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["ep2_resumed", "ep1_resumed"])
def test_ep_checkpoints_resume_at_ep_2_and_at_ep_1(runs, name):
    """Step 2's checkpoint of an ep run, read at ep 2 or without ep, continues one process's steps 3-4
    (step 4's update uses the Adam moments read back)."""
    one, _ = runs["one"]
    got, _ = runs[name]
    assert [r["step"] for r in got] == [3, 4]
    for key in ("loss", "aux_loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in one[2:]], abs=1e-5), key


def _read(ckpt: Path, keys: list[str]) -> dict:
    """Whole tensors of a checkpoint, read in this process (DCP's no_dist read, as the export's)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from shardtune.train.durable.checkpoint import SafeFileSystemReader

    md = SafeFileSystemReader(ckpt).read_metadata().state_dict_metadata
    out = {k: torch.empty(md[k].size, dtype=md[k].properties.dtype) for k in keys}
    dcp.load(out, storage_reader=SafeFileSystemReader(ckpt), no_dist=True)
    return out


@pytest.mark.timeout(900)
def test_ep_checkpoints_hold_the_whole_experts_and_optimizer_states(runs, tmp_path_factory):
    """ep 2's final checkpoint: each expert tensor and its Adam moments saved as the whole [E, ...]
    tensor, equal to one process's (no ep) within 1e-5, experts in order."""
    base = next(tmp_path_factory.getbasetemp().glob("moe*"))
    stems = [f"model.layers.{i}.mlp.experts.{t}" for i in (0, 1) for t in ("gate_up_proj", "down_proj")]
    keys = [f"model.{s}" for s in stems] + [f"optim.state.{s}.{m}" for s in stems for m in ("exp_avg", "exp_avg_sq")]
    want, got = (_read(base / n / "checkpoints" / "step_4", keys) for n in ("one", "ep2"))
    for k in keys:
        assert got[k].shape[0] == 4, k  # the tiny Mixtral's 4 experts, not a rank's 2
        assert (got[k] - want[k]).abs().max().item() < 1e-5, k


@pytest.mark.timeout(900)
def test_ep_exports_load_with_one_process_logits(runs, tmp_path_factory):
    """`checkpoint.export_hf` of the ep 2 run and `shardtune export` of the ep 2 x efsdp 2 run: the
    source's Hugging Face layout, 0 missing / unexpected keys, one process's export's logits (within
    the training's own fp32 spread), the experts in order."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune import cli

    base = next(tmp_path_factory.getbasetemp().glob("moe*"))
    out = base / "ep2_efsdp2_export"
    # `shardtune export` in this process (as tests/e2e/test_export.py): no interpreter start-up
    assert cli.main(["export", str(base / "ep2_efsdp2" / "checkpoints" / "step_4"), str(out)]) == 0
    ids = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, folder in (("one", base / "one" / "hf_export"), ("ep2", base / "ep2" / "hf_export"), ("efsdp", out)):
        model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        with torch.no_grad():
            logits[name] = model(ids).logits
    # 4 steps of fp32 sums in another order leave the weights up to 1.1e-5 apart (attention's too, not only
    # the experts'): measured 1.05e-5 on these logits (|logits| < 2.7); experts 0 and 2 swapped: 0.50
    for name in ("ep2", "efsdp"):
        assert (logits[name] - logits["one"]).abs().max().item() < 1e-4, name
    # the export's expert tensors are the checkpoint's whole tensors, bit for bit
    import safetensors.torch

    keys = [f"model.model.layers.{i}.mlp.experts.{t}" for i in (0, 1) for t in ("gate_up_proj", "down_proj")]
    saved = _read(base / "ep2" / "checkpoints" / "step_4", keys)
    exported = safetensors.torch.load_file(str(base / "ep2" / "hf_export" / "model.safetensors"))
    for k in keys:
        assert torch.equal(exported[k.removeprefix("model.")], saved[k]), k
