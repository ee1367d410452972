"""The planner's context parallelism (--cp, DeepSpeed-Ulysses all-to-all) and activation offload
(issue 30): bytes against hand derivations from docs/long-context.md, the all-to-all volume
against the Ulysses paper's, the fit and verdict levers, bad input, plan --json. Torch-free."""
from __future__ import annotations

import json

import pytest

from shardtune.cli import main
from shardtune.plan import plan
from shardtune.plan.activations import activation_bytes, activation_split
from shardtune.plan.params import Architecture

GIB = 2**30
# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json)
L, H, I, N, KV, D, V = 32, 4096, 14336, 32, 8, 128, 128256
LLAMA8B = Architecture("llama", H, I, L, N, KV, D, V, False)


def _head_and_rope(t: int, e: int = 2, chunks: int = 8) -> int:
    # docs/planner.md: final norm ((4 + e)h + 4) and LM-head input e·h a token, a 4-byte
    # log-sum-exp a token and one of K chunks' logits (e + 4)·V; RoPE's cos and sin 2·e·t·d
    return t * ((4 + e) * H + 4) + t * e * H + 4 * t + -(-t // chunks) * (e + 4) * V + 2 * e * t * D


def test_full_ac_checkpoints_are_split_by_cp_and_offloaded_whole():
    # AC full keeps each layer's input, e·(b·s/cp)·h bytes: 32 × 2 × 16,384 × 4,096 = 2^32 at 128k /
    # cp 8; the offload hooks wrap the whole forward, so the head's and RoPE's saved tensors go too
    s, cp = 131072, 8
    device, host = activation_split(LLAMA8B, 1, s, 2, "full", cp=cp, offload=True, loss_chunks=8)
    assert host == 4 * GIB + _head_and_rope(s // cp)
    on_device, none = activation_split(LLAMA8B, 1, s, 2, "full", cp=cp, loss_chunks=8)
    assert none == 0
    assert on_device - device == 4 * GIB - 4 * GIB // L  # one layer's checkpoint stays on the GPU


def test_activations_scale_as_one_over_cp():
    # no AC, one loss chunk: every saved tensor is per token, and attention's H/cp heads over all s
    # tokens are as many bytes as H heads over s/cp tokens; against cp 1's masked path the cp path
    # has no e·s mask a token and one more e·h_q (o_proj's input is the all-to-all's output)
    for cp in (2, 4, 8):
        whole = activation_bytes(LLAMA8B, 1, 8192, 2, "none", loss_chunks=1, calibrated=True)
        mask, extra = L * 2 * 8192 * 8192, L * 2 * 8192 * N * D
        assert activation_bytes(LLAMA8B, 1, 8192, 2, "none", loss_chunks=1, calibrated=True, cp=cp) * cp == (
            whole - mask + extra)


def test_8b_at_128k_cp8_by_hand():
    # docs/long-context.md: t = s/cp local tokens; the recomputed layer per local token (FSDP,
    # bf16, causal SDPA per document: no [s, s] mask) is norms 2((4+e)h + 4) + q/k/v input e·h +
    # q, K and V repeated to h_q and SDPA's output 4·e·h_q + its log-sum-exp 4n + o_proj's input
    # (the all-to-all's output) e·h_q + MLP e·h + 4e·I; with AC full the layer inputs L·e·t·h and
    # RoPE's cos/sin 2·e·t·d; the head (8 loss chunks) is smaller than the recompute, which it
    # does not overlap (docs/planner.md "AC peak").
    e, s, cp = 2, 131072, 8
    t = s // cp
    per_token = 2 * ((4 + e) * H + 4) + e * H + 5 * e * N * D + 4 * N + e * H + 4 * e * I
    recompute = t * per_token
    want = L * e * t * H + 2 * e * t * D + recompute
    r = plan("llama-3-8b", 8, seq_len=s, cp=cp, ac="full", strategies=["zero3"])
    z3 = r.strategy("zero3")
    assert z3.memory.activations == want
    assert z3.fits and z3.layout == {"dp_replicate": 1, "dp_shard": 1, "cp": 8, "tp": 1, "sequence_parallel": False}


def test_model_states_are_sharded_over_dp_shard_times_cp():
    # FSDP shards over dp_shard × cp: at a fixed world the states do not depend on how it splits
    a = plan("llama-3-8b", 8, seq_len=8192, strategies=["zero3"]).strategy("zero3").memory
    b = plan("llama-3-8b", 8, seq_len=8192, cp=8, strategies=["zero3"]).strategy("zero3").memory
    assert (a.params, a.grads, a.optimizer) == (b.params, b.grads, b.optimizer)
    # 4 + 4 + 8 bytes a parameter over 8 ranks (padding aside)
    assert (b.params + b.grads + b.optimizer) == pytest.approx(16 * 8_030_261_248 / 8, rel=1e-3)


@pytest.mark.parametrize("kv, cp", [(32, 4), (8, 8), (8, 16)])
def test_all_to_all_volume_is_the_ulysses_papers(kv, cp):
    # Jacobs et al. 2023 (arXiv 2309.14509) §3.2: an all-to-all of a message of M elements over P
    # ranks sends M/P per link; a layer's forward moves q, k, v in and the output back, 4·N·h/P
    # (N = sequence, h = hidden), each rank keeping 1/P of its own slice. With GQA k and v are
    # h_kv wide, repeated to P heads when P > KV heads. Backward moves the 4 gradients, and full
    # AC re-runs the forward's 4 in the recompute: 3 × the forward.
    heads = 64
    arch = Architecture("llama", heads * D, 4 * heads * D, 4, heads, kv, D, 32000, False)
    cfg = {"model_type": "llama", "hidden_size": heads * D, "intermediate_size": 4 * heads * D,
           "num_hidden_layers": 4, "num_attention_heads": heads, "num_key_value_heads": kv,
           "vocab_size": 32000, "tie_word_embeddings": False}
    e, s = 2, 65536
    r = plan(cfg, cp * 2, seq_len=s, cp=cp, ac="full", strategies=["zero3"], gpus_per_node=min(8, cp * 2))
    a2a = [c for c in r.strategy("zero3").collectives if c.group == "cp"]
    h, h_kv = arch.hidden_size, max(kv, cp) * D
    fwd = 4 * e * (2 * s * h + 2 * s * h_kv) / cp / 4 * (cp - 1) / cp  # per layer: q, o (h) and k, v (h_kv)
    if kv == heads:
        assert fwd == 4 * e * s * h / cp * (cp - 1) / cp  # the paper's 4Nh/P (MHA)
    assert sum(c.bytes_per_rank() for c in a2a) == pytest.approx(3 * arch.num_layers * fwd)
    assert sum(c.calls for c in a2a) == 3 * 4 * arch.num_layers


def test_cp_group_inside_a_node_uses_nvlink_and_costs_time():
    r1 = plan("llama-3-8b", 8, seq_len=65536, ac="full", cp=8, strategies=["zero3"])
    z = r1.strategy("zero3")
    assert z.timing["comm_time_s"] > 0
    # each of the cp ranks computes 1/cp of a row's FLOPs (attention: H/cp heads over the whole
    # row): 8 ranks on one 16k row compute as long as one rank on its own 16k row, / 8; the
    # all-to-alls around attention are exposed, so tokens/s per GPU is lower than without cp
    r0 = plan("llama-3-8b", 8, seq_len=16384, ac="full", strategies=["zero3"]).strategy("zero3")
    r8 = plan("llama-3-8b", 8, seq_len=16384, ac="full", cp=8, strategies=["zero3"]).strategy("zero3")
    assert 8 * r8.timing["compute_time_s"] == pytest.approx(r0.timing["compute_time_s"], rel=1e-3)
    assert r8.timing["tokens_per_s"] < r0.timing["tokens_per_s"]


def test_fit_finds_cp_for_8b_at_128k():
    from shardtune.plan.fit import search

    fit = search("llama-3-8b", gpus=8, seq_len=131072, ac="full")
    b = fit.best
    assert b is not None and b.cp > 1
    assert f"--cp {b.cp}" in b.flags() and b.global_batch == fit.base["global_batch"] == 8
    again = plan("llama-3-8b", 8, seq_len=131072, strategies=[b.strategy], ac=b.ac, cp=b.cp, precision=b.precision,
                 optimizer_impl=b.optimizer_impl, activation_offload=b.activation_offload, grad_accum=b.grad_accum,
                 micro_batch=b.micro_batch, offload=b.offload, hsdp_shard_size=b.hsdp_shard_size)
    assert again.strategy(b.strategy).fits


def test_fit_train_line_sets_cp_and_grad_accum():
    from shardtune.plan.fit import search
    from shardtune.plan.fit_line import train_line
    from shardtune.plan.validate import resolve_inputs

    base = resolve_inputs(None, 8, {"model": "llama-3-8b", "seq_len": 131072, "ac": "full"})
    fit = search(base)
    line = train_line(fit.best, base)
    assert f"--cp {fit.best.cp}" in line and f"train.grad_accum={fit.best.grad_accum}" in line


def test_verdict_suggests_cp_before_a_shorter_sequence():
    r = plan("llama-3-8b", 8, seq_len=131072, ac="full")
    for name in ("zero2", "zero3", "hsdp"):
        s = r.strategy(name)
        assert not s.fits and s.suggestion.startswith("--cp "), s.suggestion
        cp = int(s.suggestion.split()[1])
        assert plan("llama-3-8b", 8, seq_len=131072, ac="full", cp=cp, strategies=[name]).strategy(name).fits
    assert "seq-len" not in r.verdict
    assert r.strategy("ddp").suggestion.startswith("zero3 --cp")  # ddp cannot split the sequence


def test_70b_at_32k_on_64_gpus_suggests_cp():
    r = plan("llama-3.1-70b", 64, seq_len=32768, ac="full", strategies=["zero3"])
    assert r.strategy("zero3").suggestion.startswith("--cp ")


@pytest.mark.parametrize("argv, words", [
    (["--cp", "3"], "does not divide the world size 8"),
    (["--cp", "16"], "does not divide the world size 8"),
    (["--cp", "4", "--seq-len", "2050"], "multiple of 4"),
    (["--cp", "64", "--gpus", "64", "--seq-len", "4096"], "32 attention heads"),
    (["--cp", "2", "--strategy", "ddp"], "FSDP2 strategies"),
    (["--cp", "4", "--strategy", "hsdp", "--hsdp-shard-size", "4"], "data-parallel degree"),
    (["--activation-offload", "--offload", "all", "--strategy", "zero3"], "does not compose with offload"),
    (["--host-ram", "-1", "--activation-offload"], "--host-ram"),
])
def test_bad_cp_input_is_one_line_exit_2(argv, words, capsys):
    rc = main(["plan", "llama-3-8b", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_cp_needs_a_model():
    rc = main(["plan", "--params", "8e9", "--cp", "2"])
    assert rc == 2


def test_json_carries_cp_offload_and_host_ram(capsys):
    rc = main(["plan", "llama-3-8b", "--gpus", "8", "--seq-len", "131072", "--cp", "8", "--ac", "full",
               "--activation-offload", "--strategy", "zero3", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    d = json.loads(out)
    assert d["inputs"]["cp"] == 8 and d["inputs"]["activation_offload"] is True
    z3 = d["strategies"][0]
    host = z3["host_ram"]
    # 8 ranks × (the 2^32 bytes of checkpoints + the head's and RoPE's) each (test above); out and
    # back once per micro-batch, on PCIe Gen5 x16 at 80 % of its 64 GB/s
    per_rank = 4 * GIB + _head_and_rope(131072 // 8)
    assert host["activation_bytes_per_rank"] == per_rank and host["bytes_per_node"] == 8 * per_rank
    assert host["node_ram_bytes"] == 8 * 256 * GIB and host["fits"] is True
    assert host["pcie_bytes_per_step"] == 2 * per_rank and host["link"] == "pcie-gen5"
    assert host["offload_time_s"] == pytest.approx(2 * per_rank / (0.8 * 64e9))
    assert z3["layout"]["cp"] == 8


def test_host_ram_that_is_too_small_does_not_fit(capsys):
    rc = main(["plan", "llama-3-8b", "--gpus", "8", "--seq-len", "131072", "--cp", "8", "--ac", "full",
               "--activation-offload", "--host-ram", "16", "--strategy", "zero3"])
    out = capsys.readouterr().out
    assert rc == 0
    flat = " ".join(out.split())
    assert "does NOT fit" in out and "fits: none" in flat
    assert "GiB of host RAM per node, 16 GiB given (--host-ram)" in flat


def test_simulate_marks_cp_untraced(capsys):
    rc = main(["plan", "llama-3-8b", "--gpus", "8", "--seq-len", "65536", "--cp", "8", "--ac", "full",
               "--strategy", "zero3", "--simulate", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    sim = json.loads(out)["strategies"][0]["simulated"]
    assert sim["status"] == "analytic fallback" and "context parallelism" in sim["reason"]
    assert "cannot trace" in err


def test_docs_table_is_what_plan_prints(capsys):
    # docs/long-context.md "Figures": each row re-derived from the command it quotes
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "long-context.md").read_text()
    rows = re.findall(r"^\| ([\d,]+) \| (\d) \| ([\d.]+) \| ([\d.]+) \| ([\d,]+) \|", text, re.M)
    assert len(rows) == 6
    for seq, cp, peak, act, tps in rows:
        rc = main(["plan", "llama-3-8b", "--gpus", "8", "--seq-len", seq.replace(",", ""), "--cp", cp, "--ac", "full",
                   "--strategy", "zero3", "--json"])
        s = json.loads(capsys.readouterr().out)["strategies"][0]
        assert rc == 0 and s["fits"]
        assert (f"{s['memory']['total'] / GIB:.1f}", f"{s['memory']['activations'] / GIB:.1f}",
                f"{s['tokens_per_s']:,.0f}") == (peak, act, tps)


def test_readme_long_context_rows_are_what_plan_prints(capsys):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = re.findall(r"^\| (\d+)([kM]), cp (\d)(, `--activation-offload`)? \| ([\d.]+) GiB(?: \+ (\d+) GiB host RAM "
                      r"a node)?, ([\d,]+) \|", text, re.M)
    assert len(rows) == 4
    for n, unit, cp, off, peak, host, tps in rows:
        seq = int(n) * (1024 if unit == "k" else 1024 * 1024)
        argv = ["plan", "llama-3-8b", "--gpus", "8", "--seq-len", str(seq), "--cp", cp, "--ac", "full",
                "--strategy", "zero3", "--json"] + (["--activation-offload"] if off else [])
        assert main(argv) == 0
        s = json.loads(capsys.readouterr().out)["strategies"][0]
        assert (f"{s['memory']['total'] / GIB:.1f}", f"{s['tokens_per_s']:,.0f}") == (peak, tps)
        if host:
            assert f"{s['host_ram']['bytes_per_node'] / GIB:.0f}" == host


def test_all_to_all_across_nodes_is_priced_on_the_nics_not_as_a_ring():
    # cp 16 over 2 nodes of 8: each node's 8 members send 8/16 of their S bytes to the other node
    # at once, 8 · S / 2 = 4 S through the node's NICs (a ring would send S); 15 latency steps
    from shardtune.plan.ring import Cluster, Link, group_time_s

    nic, nvl = Link(400e9, 5e-6), Link(370e9, 2e-6)
    cluster = Cluster(2, 8, nvl, nic)
    S = 2**30
    assert group_time_s("all_to_all", S, 16, 8, 1, cluster) == pytest.approx(15 * 5e-6 + 4 * S / 400e9)
    # inside a node: the ring-like (n − 1)/n · S per rank on NVLink
    assert group_time_s("all_to_all", S, 8, 8, 1, cluster) == pytest.approx(7 * 2e-6 + 7 / 8 * S / 370e9)


def test_planned_activations_at_cp_2_meet_the_trainers_measured_bytes(capsys):
    # memory.json `activations_bytes` measured by the trainer (docs/long-context.md "Training: how
    # the sequence is split", tests/e2e/test_cp_cli.py: recipes/tiny-cpu.yaml, fp32, 8 rows × 128):
    # 48,648,196 at --nproc 1 and 24,328,196 a rank at --nproc 2 --cp 2
    for cp, measured in ((1, 48_648_196), (2, 24_328_196)):
        rc = main(["plan", "tiny-llama", "--gpus", str(cp), "--cp", str(cp), "--seq-len", "128", "--micro-batch", "8",
                   "--precision", "fp32", "--strategy", "zero3", "--json"])
        planned = json.loads(capsys.readouterr().out)["strategies"][0]["memory"]["activations"]
        assert rc == 0 and planned == pytest.approx(measured, rel=0.03), (cp, planned, measured)


def test_the_issues_done_when_command_prints_a_layout_that_fits(capsys):
    rc = main(["plan", "llama-3-8b", "--gpus", "8", "--seq-len", "131072", "--cp", "8", "--ac", "full"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc in (0, None) and "data-parallel 1 × context-parallel 8" in out and "fits: zero2, zero3, hsdp" in out
