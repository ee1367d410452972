"""PNG plots of a run folder with matplotlib (Agg: no display needed).

memory.png      a group of bars per category of the report's table and one for the peak, a bar per
                source drawn (predicted = plan.json, simulated = simulated.json, measured =
                memory.json's largest rank), side by side and never stacked: each category's own
                maximum need not coincide with the peak, so a stack of them would stand above it;
                per rank on CPU; GiB = 2^30 bytes (MiB under 1 GiB)
loss.png        training loss per step, its moving average, validation loss, resume markers
throughput.png  global tokens/s (all ranks) per step and its mean (metrics.jsonl)
experts.png     mixture-of-experts runs: expert load per step (expert_load_cv: std / mean of the step's
                global tokens per expert, 0 = balanced) and the load-balancing aux_loss (docs/moe.md)
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from shardtune.verify.compare import LABELS

matplotlib.use("Agg")  # files only, no display (report/render.py imports this module lazily)

STACK = ("params", "grads", "optimizer", "activations", "buffers", "optimizer_step_temp")  # the table's


def per_device(measured_method: str | None) -> str:
    """'per rank (CPU)' when the run measured on CPU (ranks, not GPUs), else 'per GPU'."""
    return "per rank (CPU)" if measured_method and "cuda" not in measured_method else "per GPU"


def memory_title(sources: dict[str, dict], strategy: str | None, measured_method: str | None) -> str:
    """What memory.png draws: per rank or per GPU, the strategy, the sources drawn."""
    return f"Memory {per_device(measured_method)}, largest rank ({strategy or 'run'}): {' / '.join(sources)}"


SOURCE_COLORS = {"predicted": "#4c72b0", "simulated": "#937860", "measured": "#c44e52"}


def draw_memory(sources: dict[str, dict], title: str):
    """Grouped bars: for each category of the report's table (its column names) and the peak, one
    bar per source (name → memory dict with the planner's keys; a missing key draws no bar), each
    from zero. Nothing is stacked: a category's maximum over the step and the peak (one moment) are
    read against the same axis."""
    keys = [*STACK, "total"]
    peak = max((m.get(k) or 0 for m in sources.values() for k in keys), default=0)
    unit, unit_name = (2**30, "GiB (2^30 B)") if peak >= 2**30 else (2**20, "MiB (2^20 B)")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = list(sources)
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        xs, hs = [], []
        for i, k in enumerate(keys):
            v = sources[name].get(k)
            if v is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                hs.append(v / unit)
        ax.bar(xs, hs, width=width, color=SOURCE_COLORS.get(name, f"C{j}"), label=name)
    ax.set_xticks(range(len(keys)), [LABELS[k] for k in keys])
    ax.axvline(len(keys) - 1.5, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("each category: its own maximum over the step; peak: the largest total at one moment\n"
                  "(categories need not peak together, so they do not add up to the peak)", fontsize="small")
    ax.set_ylabel(f"memory, {unit_name}")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
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


def draw_rewards(records: list[dict], run_name: str):
    """DPO runs (train.objective: dpo): the implicit rewards of chosen and rejected, their margin
    and the reward accuracy per step, with the held-out pairs' (val_*) where evaluated; None otherwise."""
    rows = [r for r in records if r.get("reward_margin") is not None and "step" in r]
    if not rows:
        return draw_rl_rewards(records, run_name)
    fig, (ax, acc) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    for key, color in (("reward_chosen", "#55a868"), ("reward_rejected", "#c44e52"), ("reward_margin", "#4c72b0")):
        ax.plot(steps, [r[key] for r in rows], lw=1.5, color=color, label=key.replace("_", " "))
    acc.plot(steps, [r["reward_acc"] for r in rows], lw=1.5, color="#4c72b0", label="reward accuracy")
    val = [r for r in records if r.get("val_pref_acc") is not None and "step" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_reward_margin"] for r in val], "o", color="#4c72b0",
                label="held-out reward margin")
        acc.plot([r["step"] for r in val], [r["val_reward_acc"] for r in val], "o", color="#4c72b0",
                 label="held-out reward accuracy")
        acc.plot([r["step"] for r in val], [r["val_pref_acc"] for r in val], "s", color="#dd8452",
                 label="held-out: policy prefers chosen")
    _per_step_axes(ax, "β · (log π − log π_ref), pair mean", f"{run_name}: DPO rewards")
    _per_step_axes(acc, "share of pairs", f"{run_name}: DPO accuracy")
    acc.set_ylim(-0.02, 1.02)
    fig.tight_layout()
    return fig


def draw_rl_rewards(records: list[dict], run_name: str):
    """grpo runs (docs/rl.md): the mean reward per step with each reward function's, the held-out
    reward (val_reward) where evaluated, and the completion length; None without them."""
    rows = [r for r in records if r.get("reward") is not None and r.get("completion_len") is not None]
    if not rows:
        return None
    fig, (ax, length) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["reward"] for r in rows], lw=2, color="#4c72b0", label="reward (mean)")
    for key in sorted({k for r in rows for k in r if k.startswith("reward/")}):
        ax.plot(steps, [r.get(key) for r in rows], lw=1, label=key)
    val = [r for r in records if r.get("val_reward") is not None]
    if val:
        ax.plot([r["step"] for r in val], [r["val_reward"] for r in val], "o", color="#dd8452",
                label="held-out reward (greedy)")
    length.plot(steps, [r["completion_len"] for r in rows], lw=1.5, color="#55a868", label="completion length")
    _per_step_axes(ax, "reward", f"{run_name}: GRPO rewards")
    _per_step_axes(length, "tokens", f"{run_name}: completion length")
    fig.tight_layout()
    return fig


def plot_rewards(records: list[dict], path: Path, run_name: str) -> Path | None:
    fig = draw_rewards(records, run_name)
    return _save(fig, path) if fig is not None else None


def draw_experts(records: list[dict], run_name: str):
    """MoE runs: expert_load_cv and aux_loss per step, side by side; None when no record has them."""
    cv = [(r["step"], r["expert_load_cv"]) for r in records if r.get("expert_load_cv") is not None and "step" in r]
    aux = [(r["step"], r["aux_loss"]) for r in records if r.get("aux_loss") is not None and "step" in r]
    if not cv and not aux:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if cv:
        left.plot([p[0] for p in cv], [p[1] for p in cv], "o-", lw=1.5, color="#4c72b0",
                  label="expert load CV (std / mean of tokens per expert)")
    left.axhline(0.0, ls="--", color="gray", lw=1, label="balanced (every expert the same tokens)")
    if aux:
        right.plot([p[0] for p in aux], [p[1] for p in aux], "o-", lw=1.5, color="#c44e52",
                   label="aux_loss (load balancing, before its coefficient)")
    _per_step_axes(left, "coefficient of variation", f"{run_name}: expert load per step")
    _per_step_axes(right, "aux loss", f"{run_name}: router load-balancing loss")
    right.ticklabel_format(axis="y", useOffset=False)  # read the values, not "+1.999" and the residue
    fig.tight_layout()
    return fig


def plot_experts(records: list[dict], path: Path, run_name: str) -> Path | None:
    fig = draw_experts(records, run_name)
    return _save(fig, path) if fig is not None else None
