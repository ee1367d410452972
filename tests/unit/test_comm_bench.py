"""`shardtune bench comm`: a real 2-rank gloo run, its numbers against nccl-tests' definitions."""
import json
import sys

import pytest

from shardtune.errors import UserError
from shardtune.netbench.comm_bench import parse_sizes
from shardtune.plan.ring import load_profile, profile_link
from shardtune.processes import run_bounded

pytestmark = pytest.mark.timeout(60)


def test_parse_sizes_binary_units():
    assert parse_sizes("4K,1M") == [4096, 1048576]
    assert parse_sizes("1G") == [2**30]
    with pytest.raises(UserError):
        parse_sizes("12Q")


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "profile.json"
    cmd = [sys.executable, "-m", "shardtune.cli", "bench", "comm", "--nproc", "2", "--sizes", "64K,1M",
           "-o", str(out), "--timeout", "40"]
    p = run_bounded(cmd, timeout_s=50)
    assert p.returncode == 0, p.stderr
    assert "busbw" in p.stdout and "all_gather" in p.stdout
    return json.loads(out.read_text())


def test_profile_structure_and_nccl_tests_definitions(profile):
    assert profile["world_size"] == 2 and profile["backend"] == "gloo" and profile["scope"] == "intra"
    rows = profile["results"]
    assert {(r["collective"], r["size_bytes"]) for r in rows} == {
        (k, s) for k in ("all_gather", "reduce_scatter", "all_reduce") for s in (65536, 1048576)}
    # nccl-tests PERFORMANCE.md, n = 2: algbw = S/t; busbw = algbw × 2(n-1)/n = ×1 for all-reduce,
    # × (n-1)/n = ×0.5 for all-gather and reduce-scatter.
    factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}
    for r in rows:
        assert r["time_s"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["size_bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor[r["collective"]])
    # nccl-tests' figure for the link is the largest message's busbw
    big = {r["collective"]: r["busbw_gbps"] for r in rows if r["size_bytes"] == 1048576}
    for kind, link in profile["links"].items():
        assert link["busbw_at_largest_gbps"] == pytest.approx(big[kind])


def test_profile_loads_for_the_planner(profile, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    link = profile_link(load_profile(path))
    bw, alpha = link.for_kind("reduce_scatter")
    assert bw == pytest.approx(profile["links"]["reduce_scatter"]["busbw_gbps"] * 1e9)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(UserError):
        load_profile(bad)
    with pytest.raises(UserError):
        load_profile(tmp_path / "missing.json")


def test_plan_uses_the_measured_profile(profile, tmp_path):
    from shardtune.plan import plan

    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    result = plan("tiny-llama", gpus=2, network_profile=str(path), strategies=["ddp", "zero3"])
    ar, ag, rs = (profile["links"][k] for k in ("all_reduce", "all_gather", "reduce_scatter"))
    ddp, zero3 = result.strategies
    # ddp, 2 ranks on one node (scope intra): one all-reduce of S bytes per step:
    # 2(n-1) = 2 ring steps of α + 2(n-1)/n·S = S bytes at the measured all-reduce busbw.
    (c,) = ddp.collectives
    expect_ddp = 2 * ar["alpha_s"] + c.payload_bytes / (ar["busbw_gbps"] * 1e9)
    assert ddp.timing["comm_time_s"] == pytest.approx(expect_ddp, rel=1e-3)
    # zero3: two all-gathers and one reduce-scatter, each issued per FSDP unit (4 decoder layers +
    # the root = 5 calls of (n-1) = 1 ring step each) + S/2 bytes at its own busbw; plus FSDP2's
    # copy-in/copy-out at the H100's 3.35 TB/s (all-gather 2S + 2S/2, reduce-scatter 2S + 3S/2).
    expect = 0.0
    for c in zero3.collectives:
        link = ag if c.op == "all_gather" else rs
        copies = 3.0 if c.op == "all_gather" else 3.5
        expect += (5 * link["alpha_s"] + c.payload_bytes / 2 / (link["busbw_gbps"] * 1e9)
                   + copies * c.payload_bytes / 3.35e12)
    assert zero3.timing["comm_time_s"] == pytest.approx(expect, rel=1e-3)
    assert result.hardware["network"]["network_profile"]["scope"] == "intra"


def test_alpha_beta_fit_reproduces_both_ends():
    from shardtune.netbench.profile import fit_links, result_row
    from shardtune.plan.ring import collective_time_s

    # Synthetic all-gather over 4 ranks: α = 100 µs per step, busbw 2 GB/s:
    # t(S) = 3·100e-6 + (3/4)·S / 2e9, at 64 KiB and 64 MiB (written out by hand).
    rows = [result_row("all_gather", s, 4, 3e-4 + 0.75 * s / 2e9) for s in (65536, 67108864)]
    link = fit_links(rows, 4)["all_gather"]
    assert link["busbw_gbps"] == pytest.approx(2.0) and link["alpha_s"] == pytest.approx(100e-6)
    # nccl-tests' busbw at 64 MiB still contains 3α: 0.75·S/t
    assert link["busbw_at_largest_gbps"] == pytest.approx(0.75 * 67108864 / (3e-4 + 0.75 * 67108864 / 2e9) / 1e9)
    for r in rows:
        assert collective_time_s("all_gather", r["size_bytes"], 4, link["busbw_gbps"] * 1e9,
                                 link["alpha_s"]) == pytest.approx(r["time_s"], rel=1e-9)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target, needle", [("/nonexistent/x.json", "does not exist"), ("{dir}", "is a folder")])
def test_bench_output_checked_before_measuring(tmp_path, monkeypatch, capsys, target, needle):
    from shardtune import cli
    from shardtune.netbench import comm_bench

    def no_ranks(*a, **k):
        raise AssertionError("the benchmark started for a bad -o")

    monkeypatch.setattr(comm_bench, "launch_local", no_ranks)
    rc = cli.main(["bench", "comm", "-o", target.format(dir=tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err
