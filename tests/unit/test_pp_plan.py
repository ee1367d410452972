"""The planner's pipeline parallelism (plan/pipeline.py, issue 40 item 4) against references of its own:
the bubble and the micro-batches in flight against torch.distributed.pipelining's own schedules (their
action order, timed here by a dependency simulation with backward = 2 × forward), each stage's states
against a count of Llama-3-8B's tensors from its config, the P2P bytes by hand, and the refusals
through the CLI (one line, exit 2)."""
from __future__ import annotations

import re
from unittest import mock

import pytest

from shardtune.catalog.models import resolve_model_config
from shardtune.cli import main
from shardtune.plan import plan
from shardtune.plan.pipeline import bubble_fraction, in_flight


def _torch_order(schedule: str, pp: int, m: int, v: int) -> dict[int, list]:
    """Each rank's forward/backward actions as torch's schedule class orders them (its IR). 1F1B's
    order comes from ScheduleInterleaved1F1B with one stage per rank (Megatron's 1F1B): torch 2.13's
    Schedule1F1B._get_pipeline_order numbers the last rank's forwards from 1, so its IR cannot run
    (its runtime uses its own loop); its warmup (P − i forwards) is read from that IR's first ranks."""
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )
    from torch.distributed.pipelining.schedules import _ComputationType as C
    from torch.distributed.pipelining.stage import PipelineStage

    cls = {"gpipe": ScheduleGPipe, "1f1b": ScheduleInterleaved1F1B, "1f1b-warmup": Schedule1F1B,
           "interleaved-1f1b": ScheduleInterleaved1F1B}[schedule]
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, pp, None, pp * v
    sched = cls([stage] * v if cls is ScheduleInterleaved1F1B else stage, m)
    keep = (C.FORWARD, C.FULL_BACKWARD)
    return {r: [(a.stage_index, a.computation_type == C.FORWARD, a.microbatch_index)
                for a in sched.pipeline_order[r] if a is not None and a.computation_type in keep] for r in range(pp)}


def _idle_share(order: dict[int, list], stages: int, forward_s: float, backward_s: float) -> dict[int, float]:
    """Run each rank's actions in torch's order, each as soon as its inputs exist (a forward after
    the previous stage's, a backward after the next stage's and its own forward): idle / makespan."""
    done: dict[tuple, float] = {}
    clock, pos, busy = dict.fromkeys(order, 0.0), dict.fromkeys(order, 0), dict.fromkeys(order, 0.0)
    while any(pos[r] < len(order[r]) for r in order):
        moved = False
        for r in order:
            while pos[r] < len(order[r]):
                s, fwd, mb = order[r][pos[r]]
                deps = ([(s - 1, True, mb)] if s else []) if fwd else (
                    [(s, True, mb)] + ([(s + 1, False, mb)] if s < stages - 1 else []))
                if not all(d in done for d in deps):
                    break
                took = forward_s if fwd else backward_s
                clock[r] = max([clock[r]] + [done[d] for d in deps]) + took
                busy[r] += took
                done[(s, fwd, mb)] = clock[r]
                pos[r] += 1
                moved = True
        assert moved, "the schedule deadlocks"
    span = max(clock.values())
    return {r: 1 - busy[r] / span for r in order}


@pytest.mark.parametrize("schedule,pp,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 16, 1),
                                             ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 4, 8, 4),
                                             ("interleaved-1f1b", 2, 4, 2)])
def test_bubble_and_in_flight_are_torch_schedules(schedule, pp, m, v):
    order = _torch_order(schedule, pp, m, v)
    idle = _idle_share(order, pp * v, 1.0 / v, 2.0 / v)  # a chunk does 1/v of the rank's layers
    for r in range(pp):
        assert idle[r] == pytest.approx(bubble_fraction(pp, m, schedule, v), abs=1e-12)
    warm = _torch_order("1f1b-warmup", pp, m, v) if schedule == "1f1b" else order
    for r in range(pp):
        alive = peak = 0
        for _, fwd, _ in warm[r]:
            alive += 1 if fwd else -1
            peak = max(peak, alive)
        assert peak / v == in_flight(r, pp, m, schedule, v), (r, peak)


def test_each_stage_holds_its_layers_states_sharded_over_its_data_ranks():
    """Llama-3-8B, pp 4 on 32 GPUs (zero3 over dp 8): stage 0 the embedding and 8 layers, stage 3 8
    layers, the norm and the head; fp32 params and grads, AdamW m and v (16 B a parameter) over 8 ranks,
    every dim 0 divisible by 8; fused AdamW's 4-byte step per tensor on the device."""
    hf = resolve_model_config("llama-3-8b")
    h, inter, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    kv = hf["num_key_value_heads"] * h // hf["num_attention_heads"]
    layer = 2 * h * h + 2 * kv * h + 3 * h * inter + 2 * h  # q, o, k, v, gate, up, down, two norms
    expect = {0: (8 * layer + V * h, 8 * 9 + 1), 1: (8 * layer, 72), 2: (8 * layer, 72),
              3: (8 * layer + h + V * h, 8 * 9 + 2)}
    result = plan("llama-3-8b", 32, pp=4, grad_accum=4, strategies=["zero3"])
    stages = result.to_dict()["strategies"][0]["stages"]
    for r, (numel, tensors) in expect.items():
        mem = stages[r]["memory"]
        assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * numel // 8, 4 * numel // 8,
                                                                  8 * numel // 8 + 4 * tensors), r
    assert result.strategies[0].memory.total == max(s["memory"]["total"] for s in stages)


def test_p2p_bytes_by_hand():
    """pp 4, micro-batch 2, seq 4096, tp 2 with sequence parallelism, bf16: a boundary carries
    2 × 4096 / 2 × 4096 hidden × 2 B per rank; a middle rank sends forward and backward for each of the
    8 micro-batches: 16 of them."""
    d = plan("llama-3-8b", 64, pp=4, tp=2, micro_batch=2, seq_len=4096, grad_accum=8,
             strategies=["zero3"]).to_dict()
    boundary = 2 * 4096 // 2 * 4096 * 2
    assert d["pipeline"]["boundary_bytes"] == boundary
    assert d["pipeline"]["p2p_bytes_per_step"] == 2 * 8 * boundary
    assert d["strategies"][0]["layout"]["pp"] == 4 and d["layout"] == {"pp": 4, "dp": 8, "cp": 1, "tp": 2}
    assert d["stages_of"] == "zero3" and d["stages"] == d["strategies"][0]["stages"]
    assert d["pipeline"]["bubble"] == pytest.approx(3 / 11)


def test_gpipe_keeps_every_micro_batch_and_1f1b_pp_of_them():
    """The first stage's activations: GPipe's m = 8 micro-batches against 1F1B's pp = 4 (same layers)."""
    act = {s: plan("llama-3-8b", 32, pp=4, grad_accum=8, pp_schedule=s, strategies=["zero3"]).to_dict()
           ["strategies"][0]["stages"][0]["memory"]["activations"] for s in ("gpipe", "1f1b")}
    one = plan("llama-3-8b", 32, pp=4, grad_accum=8, micro_batch=1, strategies=["zero3"])
    assert one.strategies[0].stages[0]["in_flight_microbatches"] == 4
    assert act["gpipe"] == pytest.approx(2 * act["1f1b"], rel=1e-6)


@pytest.mark.parametrize("argv,fragment", [
    (["plan", "llama-3-70b", "--gpus", "24", "--pp", "3", "--grad-accum", "3"], "do not divide the model's 80"),
    (["plan", "llama-3-8b", "--gpus", "16", "--pp", "4", "--grad-accum", "2"], "micro-batches"),
    (["plan", "llama-3-8b", "--gpus", "16", "--pp", "3", "--grad-accum", "4"], "does not divide world"),
    (["plan", "llama-3-8b", "--gpus", "16", "--pp", "4", "--tp", "8", "--grad-accum", "4"], "does not divide world"),
    (["plan", "llama-3-8b", "--gpus", "24", "--gpus-per-node", "8", "--pp", "2", "--grad-accum", "2"],
     "part of a node"),
    (["plan", "llama-3-8b", "--gpus", "16", "--pp", "2", "--grad-accum", "2", "--pp-layers", "10", "--pp-layers",
      "10"], "sum to the model's 32"),
    (["plan", "llama-3-8b", "--gpus", "16", "--pp", "2", "--grad-accum", "2", "--pp-virtual-stages", "2"],
     "interleaved-1f1b takes"),
    (["launch", "torchrun", "recipes/tiny-cpu.yaml", "--nodes", "2", "--gpus-per-node", "2", "--pp", "4",
      "--rdzv-host", "h0"], "micro-batches"),
    (["launch", "slurm", "recipes/tiny-cpu.yaml", "--nodes", "3", "--gpus-per-node", "2", "--pp", "2",
      "train.grad_accum=2"], "part of a node"),
])
def test_bad_pipeline_is_one_line_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardtune: error:") and fragment in err[0], err


def test_uneven_split_given_plans_each_stage_its_layers():
    d = plan("llama-3-70b", 24, pp=3, grad_accum=3, pp_layers=[26, 28, 26], strategies=["zero3"]).to_dict()
    assert [s["layers"] for s in d["strategies"][0]["stages"]] == [26, 28, 26]


@pytest.mark.parametrize("launcher,extra", [("torchrun", ["--rdzv-host", "h0"]), ("slurm", []),
                                            ("k8s", ["--image", "img:1"])])
def test_launch_passes_pp_to_the_nodes(launcher, extra, tmp_path, capsys):
    """`launch ... --pp 2` reaches the trainer on every node: the override in the torchrun and sbatch
    scripts, the resolved recipe in the PyTorchJob's ConfigMap; stages of 2 ranks inside nodes of 4."""
    out = tmp_path / "out"
    argv = ["launch", launcher, "recipes/tiny-cpu.yaml", "--nodes", "2", "--gpus-per-node", "4", "--pp", "2",
            "train.grad_accum=2", *extra, "-o", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    text = out.read_text()
    assert ("parallel.pp=2" in text) if launcher != "k8s" else ("pp: 2" in text)


def test_comm_bound_fsdp_across_ethernet_names_the_pipeline():
    """FSDP over 8 nodes on one 100 GbE NIC each waits on the link; the verdict re-plans the lever and
    the pipeline of one node a stage is the one that lifts the MFU most."""
    r = plan("llama-3.1-405b", 64, nodes=8, tp=8, interconnect="eth-100g", precision="bf16", ac="full",
             strategies=["zero3"])
    assert "zero3 is communication-bound" in r.verdict and "(try --pp 8 --grad-accum 8 --pp-layers 15" in r.verdict


def test_launch_on_ethernet_advises_the_pipeline_and_launches_it(tmp_path, capsys):
    """launch's communication-bound warning names the pipeline with the overrides to add; for this tp 8
    recipe the trainer's pipeline runs them (pp x tp), so no "planned only" is said and the launch with
    the overrides passes its checks and writes the job file."""
    base = ["launch", "slurm", "recipes/llama-3-70b-tp8-2x8xh100.yaml", "--nodes", "2", "--interconnect", "eth",
            "-o", str(tmp_path / "job")]
    assert main(base) == 0
    err = capsys.readouterr().err
    advice = re.search(r"Better: a pipeline across the nodes .*?: add --pp 2 (train\.grad_accum=\d+)\.", err)
    assert advice and "planned only" not in err, err
    piped = tmp_path / "job-pp"
    assert main([*base[:-1], str(piped), "--pp", "2", advice.group(1)]) == 0
    assert "parallel.pp=2" in piped.read_text() or "--pp 2" in piped.read_text(), piped.read_text()


def test_step_time_is_compute_over_one_minus_the_bubble():
    """Narayanan et al. 2021 §2.2: a pipelined step is the ideal compute stretched by the bubble,
    compute / (1 − (P − 1)/(m + P − 1)); inside one node on NVLink the rest is the exposed FSDP and P2P
    communication and the optimizer step, a few per cent."""
    s = plan("llama-3-8b", 8, pp=8, grad_accum=16, strategies=["zero3"]).strategies[0]
    t, bubble = s.timing, s.pipeline["bubble"]
    assert bubble == pytest.approx(7 / 23)
    ideal = t["compute_time_s"] / (1 - bubble)
    assert t["step_time_s"] == pytest.approx(ideal + t["exposed_comm_s"] + t["optimizer_time_s"], rel=0.01)
    assert t["bubble_time_s"] == pytest.approx(ideal - t["compute_time_s"], rel=0.02)
