"""Ring costs, α-β times, hierarchical groups and overlap against nccl-tests and hand derivations."""
import math

import pytest

from shardtune.errors import UserError
from shardtune.layout import Layout
from shardtune.plan.ring import (
    Cluster,
    CommOp,
    Link,
    bus_factor,
    collective_time_s,
    group_time_s,
    mesh_groups,
    ring_bytes_per_rank,
)
from shardtune.plan.timing import exposed_time_s, step_time, time_for_tokens

GB = 1e9


def _hsdp(c: Cluster, shard: int) -> Layout:
    """hsdp over the whole cluster with shard groups of `shard` ranks (what mesh_groups reads)."""
    return Layout.build("hsdp", c.world_size, c.gpus_per_node, shard)


def test_bus_factors_are_nccl_tests_definitions():
    # nccl-tests doc/PERFORMANCE.md: all-reduce busbw = algbw × 2(n-1)/n; all-gather and
    # reduce-scatter × (n-1)/n; broadcast × 1.
    assert bus_factor("all_reduce", 8) == pytest.approx(14 / 8)
    assert bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert bus_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert bus_factor("broadcast", 4) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0


def test_allreduce_time_reproduces_a_published_nccl_tests_row():
    # NVIDIA/nccl issue #527, one p4dn node (8×A100): size 1073741824 B, 8142.6 µs,
    # algbw 131.87 GB/s, busbw 230.77 GB/s. With α ≈ 0, time = 2(n-1)/n · S / busbw.
    t = collective_time_s("all_reduce", 1073741824, 8, 230.77 * GB, 0.0)
    assert t == pytest.approx(8142.6e-6, rel=1e-3)
    # and algbw = S / t as the table says
    assert 1073741824 / t / GB == pytest.approx(131.87, rel=1e-3)


def test_alpha_beta_counts_ring_steps():
    # 4 ranks, all-gather of 4 MB at 1 GB/s with α = 10 µs: 3 steps → 30 µs + (3/4)·4e6/1e9 = 3 ms.
    assert collective_time_s("all_gather", 4e6, 4, 1 * GB, 10e-6) == pytest.approx(30e-6 + 3e-3)
    # all-reduce: 6 steps, 2·3/4·4e6 bytes
    assert collective_time_s("all_reduce", 4e6, 4, 1 * GB, 10e-6) == pytest.approx(60e-6 + 6e-3)
    assert ring_bytes_per_rank("reduce_scatter", 8e6, 8) == pytest.approx(7e6)


def _cluster(nodes, gpus, intra_gbps, inter_gbps, alpha=0.0):
    return Cluster(nodes, gpus, Link(intra_gbps * GB, alpha, "intra"), Link(inter_gbps * GB, alpha, "inter"))


def test_flat_group_across_nodes_is_bound_by_the_node_nics():
    # 2 nodes × 8 GPUs, NVLink 370 GB/s inside, one 10 GbE NIC (1.125 GB/s) per node.
    # A ring over 16 ranks crosses each node boundary once per ring: each node sends
    # (15/16)·S over its NIC for an all-gather → t = (15/16)·S / 1.125 GB/s.
    c = _cluster(2, 8, 370, 1.125)
    g = mesh_groups(c)["world"]
    t = group_time_s("all_gather", 1e9, g.size, g.ranks_per_node, g.groups_per_node, c)
    assert t == pytest.approx(15 / 16 * 1e9 / 1.125e9)
    # inside one node the same op uses NVLink
    c1 = _cluster(1, 8, 370, 1.125)
    g1 = mesh_groups(c1)["world"]
    assert group_time_s("all_gather", 1e9, 8, g1.ranks_per_node, 1, c1) == pytest.approx(7 / 8 * 1e9 / 370e9)


def test_hsdp_replica_groups_share_the_nics():
    # 2 nodes × 8 GPUs, shard group = one node (8), replica groups = 8 pairs across the nodes.
    # Each of the 8 local ranks all-reduces its 1/8 shard (S/8) with its peer on the other node;
    # the node sends 8 × (S/8) = S bytes in total over its NICs: t = S / B_node.
    c = _cluster(2, 8, 370, 50)
    groups = mesh_groups(c, _hsdp(c, 8))
    assert groups["shard"].ranks_per_node == 8 and groups["replica"].size == 2
    rep = groups["replica"]
    t = group_time_s("all_reduce", 1e9 / 8, rep.size, rep.ranks_per_node, rep.groups_per_node, c)
    assert t == pytest.approx(1e9 / 50e9)


def test_mesh_groups_shapes_by_hand():
    c = _cluster(2, 8, 1, 1)
    g = mesh_groups(c, _hsdp(c, 4))  # shards {0-3},{4-7},...; replica j = {j, j+4, j+8, j+12}
    assert (g["shard"].size, g["shard"].ranks_per_node) == (4, 4)
    assert (g["replica"].size, g["replica"].ranks_per_node, g["replica"].groups_per_node) == (4, 2, 4)
    c4 = _cluster(4, 8, 1, 1)
    g = mesh_groups(c4, _hsdp(c4, 16))  # shard spans 2 nodes; replica {j, j+16}
    assert (g["shard"].ranks_per_node, g["shard"].groups_per_node) == (8, 1)
    assert (g["replica"].size, g["replica"].ranks_per_node, g["replica"].groups_per_node) == (2, 1, 8)
    with pytest.raises(UserError, match="hsdp shard size 5 does not divide"):  # the layout's rule
        _hsdp(c, 5)
    with pytest.raises(ValueError, match="a layout of 8 ranks on a cluster of 16"):  # another world's layout
        mesh_groups(c, Layout.build("zero3", 8, 8))


def test_exposed_time_by_timeline():
    # L = 2, comm 10 s, compute 2 s: AG1 [0,5], AG2 [5,10], F1 [5,6], F2 [10,11] → 11 s total,
    # 9 s exposed.
    assert exposed_time_s(10, 2, 2) == pytest.approx(9)
    # comm 2, compute 10: AG1 [0,1], F1 [1,6], AG2 [1,2], F2 [6,11] → 1 s exposed.
    assert exposed_time_s(2, 10, 2) == pytest.approx(1)
    assert exposed_time_s(0, 5, 4) == 0


def test_step_time_ddp_syncs_only_last_micro_batch():
    # 2 nodes × 1 GPU at 1 GB/s, no α: DDP all-reduce of 1 GB once per step (not per micro-batch),
    # no overlap: step = 4 × (1 + 2) s compute + 2·(1/2)·1e9/1e9 = 1 s comm.
    c = _cluster(2, 1, 1, 1)
    ops = [CommOp("all_reduce", 1e9, "world", "backward", count_per="step")]
    st = step_time(ops, c, mesh_groups(c), 1.0, 2.0, 4, grad_accum=4, overlap=False)
    assert st.compute_time_s == pytest.approx(12)
    assert st.comm_time_s == pytest.approx(1)
    assert st.step_time_s == pytest.approx(13)


def test_step_time_links_in_parallel_and_time_for_tokens():
    # HSDP on 2×8: shard reduce-scatter on NVLink and replica all-reduce on NICs proceed on
    # different links, so the backward's comm is the slower of the two, not their sum.
    c = _cluster(2, 8, 100, 10)
    groups = mesh_groups(c, _hsdp(c, 8))
    ops = [CommOp("reduce_scatter", 8e9, "shard", "backward"),   # 7/8·8e9/100e9 = 0.07 s
           CommOp("all_reduce", 1e9, "replica", "backward")]     # node sends 8×1e9... see below
    st = step_time(ops, c, groups, 0.0, 0.0, 1, overlap=False)
    # replica: 2 ranks, each all-reduces 1 GB (its shard), 8 groups share 10 GB/s: 1e9/(10e9/8) = 0.8 s
    assert st.backward_comm_s == pytest.approx(0.8)
    wall, gpu_h = time_for_tokens(1e9, 1000.0, 16)
    assert wall == pytest.approx(1e9 / 16000) and gpu_h == pytest.approx(1e9 / 16000 * 16 / 3600)
    assert math.isfinite(st.step_time_s)


def test_each_call_pays_its_latency():
    # 2 ranks on 2 nodes, 1 GB/s, α = 1 ms. A zero3 all-gather of 8 MB over L = 3 layers is issued
    # per FSDP unit (3 layers + root = 4 calls): 4 × 1 step × 1 ms + (1/2)·8e6 / 1e9 = 8 ms.
    from shardtune.plan.ring import op_time_s

    c = _cluster(2, 1, 1, 1, alpha=1e-3)
    op = CommOp("all_gather", 8e6, "world", "forward")
    assert op_time_s(op, mesh_groups(c), c, num_layers=3) == pytest.approx(4e-3 + 4e-3)
    # DDP: 60 MiB of grads go in 3 buckets of 25 MiB (torch's bucket_cap_mb): 3 × 2 steps × α
    ddp = CommOp("all_reduce", 60 * 2**20, "world", "backward", count_per="step")
    assert op_time_s(ddp, mesh_groups(c), c, num_layers=3) == pytest.approx(6e-3 + 60 * 2**20 / 1e9)


def test_interconnect_catalogue_is_sane_and_cited():
    from shardtune.catalog.interconnects import INTERCONNECTS, get_interconnect

    for link in INTERCONNECTS.values():
        assert link.source and link.scope in ("intra", "inter")
        # a measured busbw cannot beat the wire (nccl-tests: busbw is comparable to the peak)
        assert 0 < link.achieved_busbw_gbps <= link.line_rate_gbps
        assert (link.nics_per_node >= 1) == (link.scope == "inter")
    # line rates by hand: 400 Gb/s / 8 = 50 GB/s; 10 Gb/s / 8 = 1.25 GB/s
    assert get_interconnect("ib-ndr-400").line_rate_gbps == 50.0
    assert get_interconnect("eth-10g").line_rate_gbps == 1.25
    with pytest.raises(UserError, match="did you mean"):
        get_interconnect("eth-10gb")
    with pytest.raises(UserError):
        get_interconnect("nvlink-h100", scope="inter")


def test_zero1_broadcasts_one_model_for_bytes_and_time():
    # ZeroRedundancyOptimizer, n = 4, fp32, 1e6 trainable params: each rank broadcasts its
    # partition B = 1e6 bytes (S = 4e6 in all). By hand, a pipelined chain root → … → last:
    from shardtune.plan.comm import bytes_per_step, collectives
    from shardtune.plan.ring import op_time_s

    n, S, alpha, bw = 4, 4e6, 1e-3, 1 * GB
    sent = [0.0] * n
    for root in range(n):
        chain = [(root + i) % n for i in range(n)]
        for rank in chain[:-1]:  # every rank but the last forwards all B bytes
            sent[rank] += S / n
    assert sent == [3e6] * n  # (n−1)/n · S each
    (_, bcast) = collectives("zero1", num_params=10**6, trainable_params=10**6, world_size=n,
                             shard_degree=n, precision="fp32")
    assert bcast.op == "broadcast" and bcast.payload_bytes == S
    assert bcast.bytes_per_rank() == pytest.approx(sent[0])
    assert ring_bytes_per_rank("broadcast", S, n) == pytest.approx(sent[0])  # the one model
    # the all-reduce (2·3/4·4e6 = 6e6) plus the broadcasts, once per step whatever the accumulation
    assert bytes_per_step([bcast], grad_accum=4) == 3e6
    # time: n chains one after another, each (n−1) hops of α and B / bw once the pipe is full:
    # n·((n−1)α + B/bw) = 12 ms + S/bw — S/bw, not (n−1)/n·S/bw: one link idles in each chain.
    c = _cluster(1, n, 1, 1, alpha=alpha)
    assert op_time_s(bcast, mesh_groups(c), c) == pytest.approx(n * ((n - 1) * alpha + S / n / bw))


def test_hsdp_replica_all_reduce_once_per_step():
    # hsdp, 4 ranks = 2 replicas × shard 2, fp32, P = 1e6 (even: no padding), grad_accum 2.
    # Per micro-batch in the shard group (n = 2): all-gather fwd + bwd and reduce-scatter of 4P
    # bytes, each (1/2)·4P = 2P sent → 6P; two micro-batches 12P. The replica all-reduce of the
    # 2P-byte grad shard over 2 replicas sends 2·(1/2)·2P = 2P, once (train/core/step.py
    # set_requires_all_reduce): 14P in all (FSDP2's default, per micro-batch, would be 16P).
    from shardtune.plan.comm import bytes_per_step, collectives

    P = 10**6
    colls = collectives("hsdp", num_params=P, trainable_params=P, world_size=4, shard_degree=2,
                        precision="fp32")
    replica = [c for c in colls if c.group == "replica"]
    assert [(c.op, c.count_per) for c in replica] == [("all_reduce", "step")]
    assert bytes_per_step(colls, grad_accum=2) == 14 * P


def test_step_time_per_step_op_on_another_link_runs_beside_the_last_micro_batch():
    # HSDP on 2×8, no overlap, no compute, 2 micro-batches: the shard reduce-scatter (NVLink,
    # 0.07 s) every micro-batch; the replica all-reduce (NICs, 0.8 s, as above) once, in the last
    # micro-batch's backward, beside that micro-batch's reduce-scatter: 0.07 + max(0.07, 0.8).
    c = _cluster(2, 8, 100, 10)
    ops = [CommOp("reduce_scatter", 8e9, "shard", "backward"),
           CommOp("all_reduce", 1e9, "replica", "backward", count_per="step")]
    st = step_time(ops, c, mesh_groups(c, _hsdp(c, 8)), 0.0, 0.0, 1, grad_accum=2, overlap=False)
    assert st.exposed_comm_s == pytest.approx(0.07 + 0.8)
    assert st.comm_time_s == pytest.approx(2 * 0.07 + 0.8)


@pytest.mark.parametrize("backend,device,warned", [
    ("gloo", "cpu", True), ("nccl", "NVIDIA A100-SXM4-80GB", True), ("nccl", "NVIDIA H100 80GB HBM3", False)])
def test_network_profile_from_another_backend_or_device_is_warned(tmp_path, capsys, backend, device, warned):
    import json as _json

    from shardtune.cli import main as _main

    prof = {"backend": backend, "device": device, "world_size": 8, "num_nodes": 1, "scope": "intra",
            "links": {"all_reduce": {"busbw_gbps": 300.0, "alpha_s": 1e-5}}}
    path = tmp_path / "net.json"
    path.write_text(_json.dumps(prof))
    assert _main(["plan", "llama-3-8b", "--gpu", "h100-80gb", "--network-profile", str(path)]) in (0, None)
    out = " ".join(capsys.readouterr().out.split())  # the console may wrap the note
    assert ("note: warning: network profile" in out) == warned, out
    if warned:
        assert f"measured with {backend} on {device}, not nccl on h100-80gb" in out
    assert _main(["plan", "llama-3-8b", "--fit", "--network-profile", str(path)]) in (0, None)
    assert ("warning: network profile" in capsys.readouterr().out) == warned
