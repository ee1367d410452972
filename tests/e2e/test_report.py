"""`shardtune report RUN_DIR` as a user runs it: train tiny-cpu on 2 processes, save a simulation
beside it, then draw the plots and print predicted / simulated / measured differences (the run,
its simulation and its report are shared with test_clean_output: `reported_run`)."""
from __future__ import annotations

import json

import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_report_after_train_and_simulate(reported_run):
    # train (tiny-cpu, 2 processes, 4 steps), plan --simulate --json > run/simulated.json, report: one
    # session run shared with test_clean_output (_cli.train_simulate_report, COLUMNS=140 for both)
    run, train, report = reported_run
    train_log, out = train.stdout + train.stderr, report.stdout + report.stderr
    assert train.returncode == 0, train_log[-3000:]
    memory = json.loads((run / "memory.json").read_text())
    # every CPU run carries the tracker's categories of one step, per rank
    assert all({"params", "activations", "buffers", "total"} <= set(r["tracked"]) for r in memory["per_rank"])
    assert json.loads((run / "simulated.json").read_text())  # the simulation, saved as the docs say
    assert report.returncode == 0, out
    for name in ("memory.png", "loss.png", "throughput.png"):
        data = (run / "plots" / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name
    assert "Δ measured vs predicted" in out and "Δ measured vs simulated" in out
    assert "Memory per rank (CPU), largest rank" in out and "per GPU" not in out  # gloo ranks, not GPUs
    # the train summary and the report print the same measured peak: memory.json's largest tracked step
    peak_mib = f"{max(r['tracked']['total'] for r in memory['per_rank']) / 2**20:,.2f} MiB"
    assert f"measured peak (largest rank): {peak_mib}" in train_log, train_log[-2000:]
    assert f"measured peak (largest rank): {peak_mib}" in out
    # and every component from the same step: the summary's activations row is the tracker's
    act_mib = f"{max(r['tracked']['activations'] for r in memory['per_rank']) / 2**20:,.2f} MiB"
    act_row = next(line for line in train_log.splitlines() if "activations" in line and "MiB" in line)
    assert act_mib in act_row, act_row
    # the measured row shows the run's own largest-rank params (memory.json), in MiB
    params_mib = max(r["tracked"]["params"] for r in memory["per_rank"]) / 2**20
    measured_row = next(line for line in out.splitlines() if " measured " in f" {line} " and "Δ" not in line)
    assert f"{params_mib:,.2f}" in measured_row
    # sharded states: predicted, simulated and measured params agree exactly
    delta_row = next(line for line in out.splitlines() if "Δ measured vs predicted" in line)
    assert delta_row.split()[4] == "+0.0%"


@pytest.mark.e2e
def test_report_bad_folder_is_one_line_exit_2(tmp_path):
    from shardtune.cli import main

    assert main(["report", str(tmp_path / "nope")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2


@pytest.mark.timeout(120)
def test_report_skips_a_last_line_cut_by_a_kill_with_a_note(tmp_path, capsys):
    from shardtune.cli import main

    run = tmp_path / "run"
    run.mkdir()
    good = [{"step": 1, "loss": 5.5, "tokens_per_s": 100.0}, {"step": 2, "loss": 4.25, "tokens_per_s": 300.0}]
    text = "".join(json.dumps(r) + "\n" for r in good)
    (run / "metrics.jsonl").write_text(text + '{"step": 3, "lo')  # killed mid-write
    assert main(["report", str(run)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert "line 3 is incomplete" in out and "5.5000 (step 1) → 4.2500 (step 2)" in out
    assert "200 tokens/s mean" in out  # (100 + 300) / 2: the cut line counted nowhere
    (run / "metrics.jsonl").write_text('{"step": 1, "lo\n' + text)  # damaged in the middle: refused
    assert main(["report", str(run)]) == 2
    assert "line 1" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["string loss", "bool step", "bad yaml", "config not a mapping", "plots a file"])
def test_report_on_a_damaged_run_folder_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, damage):
    from shardtune.cli import main

    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": 1, "loss": 5.5, "tokens_per_s": 100.0}, {"step": 2, "loss": 4.25, "tokens_per_s": 300.0}]
    (run / "config.yaml").write_text("name: r\nparallel: {strategy: zero3}\n")
    if damage == "string loss":
        records[0]["loss"] = "5.5"
    elif damage == "bool step":
        records[1]["step"] = True
    elif damage == "bad yaml":
        (run / "config.yaml").write_text("name: [r\n")
    elif damage == "config not a mapping":
        (run / "config.yaml").write_text("- a list\n")
    else:
        (run / "plots").write_text("a user's file")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    before = {f.name: f.read_bytes() for f in run.iterdir()}
    assert main(["report", str(run)]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and len(err.strip().splitlines()) == 1, err
    assert {f.name: f.read_bytes() for f in run.iterdir()} == before  # nothing written, nothing lost


def test_loss_and_throughput_plots_draw_what_their_labels_say():
    import pandas as pd

    from shardtune.report.plots import draw_loss, draw_throughput

    losses = [5.0, 4.0, 4.5, 3.0, 2.5, 2.75]
    records = [{"step": s, "loss": v, "tokens_per_s": 100.0 * s} for s, v in enumerate(losses, 1)]
    records[3]["val_loss"], records[5]["val_loss"] = 3.5, 3.25
    records[4]["resumed_from"] = 4  # the first step after a resume
    fig = draw_loss(records, "my-run")
    ax = fig.axes[0]
    assert "my-run" in ax.get_title()
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert list(lines["validation loss"].get_xdata()) == [4, 6]
    assert list(lines["validation loss"].get_ydata()) == [3.5, 3.25]
    assert list(lines["training loss"].get_ydata()) == losses
    want = pd.Series(losses).ewm(alpha=0.1, adjust=True).mean().tolist()  # pandas' debiased EMA
    assert list(lines["training loss, smoothed (EMA 0.9)"].get_ydata()) == pytest.approx(want)
    assert list(lines["resumed"].get_xdata()) == [4.5, 4.5]  # between step 4 and step 5
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert legend == set(lines)
    fig = draw_throughput(records, "my-run", 2)
    ax = fig.axes[0]
    assert "global" in ax.get_title() and "2 rank(s)" in ax.get_title() and "global" in ax.get_ylabel()
    mean_line = next(ln for ln in ax.get_lines() if ln.get_label().startswith("mean"))
    assert list(mean_line.get_ydata()) == [350.0, 350.0]  # (100 + ... + 600) / 6
    assert mean_line.get_label() == "mean 350 tokens/s"


def test_memory_plot_draws_what_its_title_and_legend_say():
    from matplotlib.patches import Rectangle

    from shardtune.report.plots import draw_memory, memory_title

    mib = 2**20
    predicted = {"params": 4 * mib, "grads": 4 * mib, "optimizer": 8 * mib, "activations": 2 * mib,
                 "buffers": 1 * mib, "optimizer_step_temp": 3 * mib, "total": 20 * mib}
    measured = {"params": 4 * mib, "grads": 4 * mib, "optimizer": 8 * mib, "activations": 3 * mib, "total": 19 * mib}
    sources = {"predicted": predicted, "measured": measured}
    title = memory_title(sources, "zero3", "cpu: torch's memory tracker")
    assert "simulated" not in title and "per rank (CPU)" in title and "per GPU" not in title
    assert "per GPU" in memory_title(sources, "zero3", "cuda max_memory_allocated")
    fig = draw_memory(sources, title)
    ax = fig.axes[0]
    assert ax.get_title() == title
    # one group per column of the report's table (verify/compare.py prints them) and the peak
    assert [t.get_text() for t in ax.get_xticklabels()] == ["params", "grads", "optim", "activ", "buffers",
                                                            "opt tmp", "peak"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["predicted", "measured"]
    # every bar from zero (nothing stacked), its height the source's value in MiB; a source's peak
    # bar is its tallest: no category stands above the peak it is part of
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert all(p.get_y() == 0 for p in bars)
    by_source = {}
    for container, name in zip(ax.containers, ["predicted", "measured"]):
        by_source[name] = [p.get_height() for p in container]
    assert by_source["predicted"] == pytest.approx([4, 4, 8, 2, 1, 3, 20])
    assert by_source["measured"] == pytest.approx([4, 4, 8, 3, 19])  # no buffers / opt tmp measured: no bar
    for heights in by_source.values():
        assert max(heights) == heights[-1]
    assert "MiB" in ax.get_ylabel()
