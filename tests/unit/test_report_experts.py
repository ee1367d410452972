"""`shardtune report RUN` draws expert load over steps (experts.png) for runs whose metrics have it."""
import json

import numpy as np


def _moe_records():
    counts = [[30, 34, 32, 32], [10, 50, 40, 28], [64, 0, 0, 64]]  # tokens per expert at steps 1..3
    cvs = [float(np.std(c) / np.mean(c)) for c in counts]  # population std / mean, computed here
    return [{"step": s, "loss": 2.0 / s, "tokens_per_s": 100.0, "aux_loss": 2.0 + 0.1 * s, "expert_load_cv": cv}
            for s, cv in enumerate(cvs, 1)], cvs


def test_experts_plot_draws_the_metrics_per_step():
    from shardtune.report.plots import draw_experts

    records, cvs = _moe_records()
    records.insert(1, {"step": 2, "val_loss": 1.5})  # an evaluation row carries neither: skipped
    fig = draw_experts(records, "moe-run")
    left, right = fig.axes
    assert "moe-run" in left.get_title() and "expert load" in left.get_title()
    lines = {ln.get_label(): ln for ax in fig.axes for ln in ax.get_lines()}
    cv = lines["expert load CV (std / mean of tokens per expert)"]
    assert list(cv.get_xdata()) == [1, 2, 3] and list(cv.get_ydata()) == cvs
    assert cvs[0] < 0.06 and cvs[2] == 1.0  # nearly balanced, then two experts idle
    aux = lines["aux_loss (load balancing, before its coefficient)"]
    assert list(aux.get_xdata()) == [1, 2, 3] and list(aux.get_ydata()) == [2.1, 2.2, 2.3]
    assert not right.yaxis.get_major_formatter().get_useOffset()  # values on the axis, not an offset
    assert {t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()} == set(lines)
    assert draw_experts([{"step": 1, "loss": 2.0}], "dense") is None


def test_report_writes_experts_png_for_moe_runs_only(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "500")  # "wrote PATH" on one line, however long the temporary path
    from shardtune.cli import main

    records, _ = _moe_records()
    for name, rows in (("moe", records), ("dense", [{k: r[k] for k in ("step", "loss")} for r in records])):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert main(["report", str(run)]) == 0
        png = run / "plots" / "experts.png"
        assert png.is_file() == (name == "moe")
    assert (tmp_path / "moe" / "plots" / "experts.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote " + str(tmp_path / "moe" / "plots" / "experts.png") in capsys.readouterr().out
    (tmp_path / "moe" / "metrics.jsonl").write_text(json.dumps({"step": 1, "expert_load_cv": "0.4"}) + "\n")
    assert main(["report", str(tmp_path / "moe")]) == 2  # a damaged figure is refused, not drawn
