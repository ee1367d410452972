"""`shardtune plan ... --ep N` (plan/ep.py) against hand computation from Qwen3-30B-A3B's published
config (Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers, 128 experts of moe_intermediate 768,
top-8, every layer routed): expert states per GPU, the all-to-all bytes, the imbalance factor, the
link the ep group spans, `--fit` searching ep, and the one-line refusals."""
from __future__ import annotations

import json

import pytest
from _cli import refused_before_any_process

from shardtune.layout import Layout
from shardtune.plan import plan
from shardtune.plan.fit import search
from shardtune.plan.ring import Cluster, Link, mesh_groups

H, LAYERS, E, I, K = 2048, 48, 128, 768, 8  # Qwen/Qwen3-30B-A3B config.json
EXPERT = 3 * I * H  # gate_up (2I, h) + down (h, I) of one expert
BF16_MIXED = 4 + 4 + 8  # fp32 param + fp32 grad + Adam m, v (fp32) per trained element


def _zero3(**kw) -> dict:
    out = plan("qwen3-30b-a3b", kw.pop("gpus", 8), strategies=["zero3"], **kw).to_dict()
    return out["strategies"][0]


@pytest.mark.parametrize("gpus, ep", [(8, 8), (16, 8), (8, 4)])
def test_expert_states_per_gpu_are_the_published_experts_over_ep_times_expert_fsdp(gpus, ep):
    s = _zero3(gpus=gpus, ep=ep)
    efsdp = gpus // ep
    per_gpu = LAYERS * (E // ep) * EXPERT // efsdp  # E/ep experts a rank, then sharded over efsdp (even here)
    counters = 4 * 2 * LAYERS  # torch's fused AdamW: one fp32 `step` tensor per expert tensor (2 a layer)
    assert s["memory"]["experts"] == per_gpu * BF16_MIXED + counters
    assert s["layout"]["ep"] == ep and s["layout"]["expert_fsdp"] == efsdp


def test_dense_states_are_as_without_ep():
    def dense(s):
        m = s["memory"]
        return m["params"] + m["grads"] + m["optimizer"] - m["experts"]
    assert dense(_zero3(ep=8)) == dense(_zero3(ep=1))
    # and ep 8 × expert-FSDP 1 holds what zero3 over 8 ranks holds for the experts: 1/8 of them each
    assert _zero3(ep=8)["memory"]["experts"] == _zero3(ep=1)["memory"]["experts"]


@pytest.mark.parametrize("tp, cp", [(2, 1), (1, 2)])
def test_with_tp_or_cp_the_experts_are_whole_rows_of_ep_over_the_data_ranks(tp, cp):
    """ep 4 on 8 GPUs with tp 2 or cp 2 (docs/moe.md "ep with tp and cp"): the experts are not tp-split,
    each tp rank holds its E/ep experts whole (tp ranks are their replicas); cp ranks are data ranks for
    the experts (ep divides dp_shard x cp). tp: dp_shard 4 / ep 4 = expert-FSDP 1; cp: 4 x 2 / 4 = 2."""
    s = _zero3(ep=4, tp=tp, cp=cp)
    efsdp = 8 // tp // 4
    per_gpu = LAYERS * (E // 4) * EXPERT // efsdp
    assert s["memory"]["experts"] == per_gpu * BF16_MIXED + 4 * 2 * LAYERS  # + fused AdamW's step counters
    assert (s["layout"]["ep"], s["layout"]["expert_fsdp"], s["layout"]["tp"], s["layout"]["cp"]) == (4, efsdp, tp, cp)
    # each rank routes its cp slice of the 2048-token micro-batch, each tp rank 1/tp of that (its own rows)
    tokens = 2048 // (tp * cp)
    assert s["comm"]["all_to_all"]["bytes_per_rank_per_layer"] == round(2 * 2 * tokens * K * H * 2 * (4 - 1) / 4)


@pytest.mark.parametrize("ac, imbalance", [("none", 1.0), ("full", 1.0), ("none", 1.5)])
def test_all_to_all_bytes_per_layer_and_step(ac, imbalance):
    tokens = 2048  # seq 2048 × micro-batch 1
    per_layer = 2 * 2 * tokens * K * H * 2 * (8 - 1) / 8 * imbalance  # dispatch + combine, fwd + bwd, bf16
    s = _zero3(ep=8, ac=ac, moe_imbalance=imbalance)
    a2a = s["comm"]["all_to_all"]
    assert a2a["bytes_per_rank_per_layer"] == round(per_layer) and a2a["moe_layers"] == LAYERS
    sent = sum(c["bytes_per_rank"] for c in s["collectives"] if c["group"] == "ep")
    recomputed = 1.5 if ac == "full" else 1.0  # AC re-runs the forward's dispatch and combine
    assert sent == pytest.approx(LAYERS * per_layer * recomputed, rel=1e-9)
    assert "comm" not in _zero3(ep=1)  # without ep the plan is as before


def test_imbalance_scales_the_busiest_ranks_expert_compute():
    flops = 989.4e12 * 0.40  # h100-80gb's dense bf16 peak × the default MFU
    routed = LAYERS * K * EXPERT  # routed weights a token multiplies by
    extra = 0.5 * 6 * routed * 2048 / flops  # f - 1 = 0.5 more forward (2) + backward (4) FLOPs
    balanced, busy = _zero3(ep=8), _zero3(ep=8, moe_imbalance=1.5)
    # the plan's times carry 4 significant digits (0.1190 s, 0.1472 s): ± 1e-4 on the difference
    assert busy["compute_time_s"] - balanced["compute_time_s"] == pytest.approx(extra, abs=1e-4)
    assert busy["step_time_s"] > balanced["step_time_s"]


def test_the_ep_group_is_priced_on_the_link_it_spans():
    cluster = Cluster(2, 8, Link(1e11, 1e-6, "nvlink"), Link(1e10, 1e-5, "ib"))
    inside, across = (mesh_groups(cluster, Layout.build("zero3", 16, 8, ep=e)) for e in (8, 16))
    assert (inside["ep"].size, inside["ep"].ranks_per_node) == (8, 8)  # one node's consecutive ranks
    assert (across["ep"].size, across["ep"].ranks_per_node) == (16, 8)  # spans both nodes
    assert (inside["efsdp"].size, inside["efsdp"].ranks_per_node) == (2, 1)  # ep apart: one per node
    # ep 8 on 2 nodes: the all-to-all on NVLink, but each expert's FSDP pair spans the nodes (8 ranks
    # apart); ep 16: no expert FSDP traffic, the all-to-all on the NICs
    one, two = _zero3(gpus=16, ep=8), _zero3(gpus=16, ep=16)
    assert {c["group"] for c in one["collectives"]} >= {"efsdp", "ep"}
    assert "efsdp" not in {c["group"] for c in two["collectives"]}


def test_fit_searches_ep_for_moe_models_only():
    fit = search("qwen3-30b-a3b", 8)
    assert fit.best.ep > 1 and f"--ep {fit.best.ep}" in fit.best.flags()
    assert fit.best.tokens_per_s > max(c.tokens_per_s for c in search("qwen3-30b-a3b", 8, ep=1, keep=frozenset(
        {"ep"})).ranked)
    assert {c.ep for c in search("llama-3-8b", 8).ranked} == {1}


@pytest.mark.parametrize("args, needle", [
    (["llama-3-8b", "--gpus", "8", "--ep", "2"], "needs a mixture-of-experts model"),
    (["qwen3-30b-a3b", "--gpus", "6", "--ep", "3"], "does not divide the 128 experts"),
    (["qwen3-30b-a3b", "--gpus", "8", "--ep", "16"], "does not divide the 8 data-parallel ranks"),
    (["qwen3-30b-a3b", "--gpus", "8", "--ep", "8", "--strategy", "ddp"], "does not compose with strategy 'ddp'"),
    (["qwen3-30b-a3b", "--gpus", "16", "--ep", "16", "--strategy", "hsdp"], "must divide dp_shard x cp = 8"),
    (["qwen3-30b-a3b", "--gpus", "8", "--ep", "8", "--moe-imbalance", "0.5"], "--moe-imbalance 0.5"),
    (["qwen3-30b-a3b", "--gpus", "8", "--tp", "2"], "needs expert parallelism"),  # experts not tp-split
])
def test_plan_refuses_in_one_line(monkeypatch, capsys, args, needle):
    assert needle in refused_before_any_process(monkeypatch, capsys, ["plan", *args])


def test_plan_json_through_the_cli(capsys):
    from shardtune import cli

    assert cli.main(["plan", "qwen3-30b-a3b", "--gpus", "8", "--ep", "8", "--strategy", "zero3", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["strategies"][0]
    assert s["layout"]["ep"] == 8 and s["comm"]["all_to_all"]["group_size"] == 8 and s["fits"]
