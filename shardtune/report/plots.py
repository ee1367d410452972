"""PNG plots of a run folder with matplotlib (Agg: no display needed).

memory.png      stacked bars per source drawn (predicted = plan.json, simulated = simulated.json,
                measured = memory.json's largest rank) by the table's categories, each source's
                peak as a marker; per rank on CPU; GiB = 2^30 bytes (MiB under 1 GiB)
loss.png        training loss per step, its moving average, validation loss, resume markers
throughput.png  global tokens/s (all ranks) per step and its mean (metrics.jsonl)
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

matplotlib.use("Agg")  # files only, no display (report/commands.py imports this module lazily)

STACK = ("params", "grads", "optimizer", "activations", "buffers", "optimizer_step_temp")  # the table's
COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
          "buffers": "#8172b3", "optimizer_step_temp": "#937860"}


def per_device(measured_method: str | None) -> str:
    """'per rank (CPU)' when the run measured on CPU (ranks, not GPUs), else 'per GPU'."""
    return "per rank (CPU)" if measured_method and "cuda" not in measured_method else "per GPU"


def memory_title(sources: dict[str, dict], strategy: str | None, measured_method: str | None) -> str:
    """What memory.png draws: per rank or per GPU, the strategy, the sources drawn."""
    return f"Memory {per_device(measured_method)}, largest rank ({strategy or 'run'}): {' / '.join(sources)}"


def draw_memory(sources: dict[str, dict], title: str):
    """Stacked bars of `sources` (name → memory dict with the planner's keys; missing keys are 0),
    one legend entry per category of the report's table (its column names), and a black marker at
    each source's `total` (its peak)."""
    from shardtune.verify.compare import LABELS  # the table's column names

    peak = max((m.get("total") or sum(m.get(k) or 0 for k in STACK) for m in sources.values()), default=0)
    unit, unit_name = (2**30, "GiB (2^30 B)") if peak >= 2**30 else (2**20, "MiB (2^20 B)")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(sources)
    for i, name in enumerate(names):
        bottom = 0.0
        for k in STACK:
            v = (sources[name].get(k) or 0) / unit
            ax.bar(i, v, bottom=bottom, color=COLORS[k], label=LABELS[k] if i == 0 else None, width=0.6)
            bottom += v
    marked = [i for i, name in enumerate(names) if sources[name].get("total")]
    for j, i in enumerate(marked):
        ax.plot([i - 0.35, i + 0.35], [sources[names[i]]["total"] / unit] * 2, color="black", lw=2,
                label=f"{LABELS['total']} (one moment)" if j == 0 else None)
    ax.set_xticks(range(len(names)), names)
    ax.set_xlabel("bars: each category's own maximum over the step (they need not coincide)", fontsize="small")
    ax.set_ylabel(f"memory, {unit_name}")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return fig


def plot_memory(sources: dict[str, dict], path: Path, title: str) -> Path:
    return _save(draw_memory(sources, title), path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def smooth(values: list[float], alpha: float = 0.9) -> list[float]:
    """Exponential moving average (TensorBoard's smoothing, debiased like Adam's moments)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = alpha * avg + (1 - alpha) * v
        out.append(avg / (1 - alpha ** i))
    return out


def draw_loss(records: list[dict], run_name: str):
    """The loss figure: training loss per step, its moving average, validation loss, and a dashed
    line at each resume (None when no record has a loss)."""
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None and "step" in r]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None and "step" in r]
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        steps, losses = [p[0] for p in train], [p[1] for p in train]
        ax.plot(steps, losses, lw=1, alpha=0.35, color="#4c72b0", label="training loss")
        if len(train) > 2:
            ax.plot(steps, smooth(losses), lw=1.8, color="#4c72b0", label="training loss, smoothed (EMA 0.9)")
    if val:
        ax.plot([p[0] for p in val], [p[1] for p in val], "o-", lw=1.5, color="#c44e52", label="validation loss")
    for i, step in enumerate(r["step"] for r in records if r.get("resumed_from") is not None):
        ax.axvline(step - 0.5, ls="--", color="gray", lw=1, label="resumed" if i == 0 else None)
    _per_step_axes(ax, "loss (token mean)", f"{run_name}: loss per step")
    return fig


def _per_step_axes(ax, ylabel: str, title: str) -> None:
    """Labels, grid and legend of a curve over optimizer steps (whole numbers on the step axis)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot_loss(records: list[dict], path: Path, run_name: str) -> Path | None:
    fig = draw_loss(records, run_name)
    return _save(fig, path) if fig is not None else None


def draw_throughput(records: list[dict], run_name: str, world_size: int | None):
    """Global tokens/s (all ranks together) per step and its mean over the steps drawn."""
    points = [(r["step"], r["tokens_per_s"]) for r in records if r.get("tokens_per_s") is not None]
    if not points:
        return None
    mean = sum(p[1] for p in points) / len(points)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.5, label="tokens/s, global (all ranks)")
    ax.axhline(mean, ls="--", color="black", lw=1, label=f"mean {mean:,.0f} tokens/s")
    ranks = f" over {world_size} rank(s)" if world_size else ""
    _per_step_axes(ax, "tokens/s, global", f"{run_name}: global throughput{ranks} (train_step time)")
    return fig


def plot_throughput(records: list[dict], path: Path, run_name: str, world_size: int | None) -> Path | None:
    fig = draw_throughput(records, run_name, world_size)
    return _save(fig, path) if fig is not None else None
