"""PNG plots of a run folder with matplotlib (Agg: no display needed).

memory.png      stacked bars per source (predicted = plan.json, simulated = simulated.json,
                measured = memory.json's largest rank) by category, each source's peak as a
                marker; GiB = 2^30 bytes (MiB when the peak is under 1 GiB)
loss.png        loss per step (metrics.jsonl)
throughput.png  tokens/s per step (metrics.jsonl)
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

matplotlib.use("Agg")  # files only, no display (report/commands.py imports this module lazily)

STACK = ("params", "grads", "optimizer", "activations", "buffers")
COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
          "buffers": "#8172b3"}


def plot_memory(sources: dict[str, dict], path: Path, title: str) -> Path:
    """Stacked bars of `sources` (name → memory dict with the planner's keys; missing keys are 0)
    and a black marker at each source's `total` (its peak)."""
    peak = max((m.get("total") or sum(m.get(k) or 0 for k in STACK) for m in sources.values()), default=0)
    unit, unit_name = (2**30, "GiB (2^30 B)") if peak >= 2**30 else (2**20, "MiB (2^20 B)")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(sources)
    for i, name in enumerate(names):
        bottom = 0.0
        for k in STACK:
            v = (sources[name].get(k) or 0) / unit
            ax.bar(i, v, bottom=bottom, color=COLORS[k], label=k if i == 0 else None, width=0.6)
            bottom += v
        if sources[name].get("total"):
            ax.plot([i - 0.35, i + 0.35], [sources[name]["total"] / unit] * 2, color="black", lw=2,
                    label="peak (one moment)" if i == 0 else None)
    ax.set_xticks(range(len(names)), names)
    ax.set_xlabel("bars: each category's own maximum over the step (they need not coincide)", fontsize="small")
    ax.set_ylabel(f"per-GPU memory, {unit_name}")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_series(records: list[dict], key: str, path: Path, ylabel: str, title: str) -> Path | None:
    """One line of `key` against `step` (None, and no file, when no record has the key)."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None and "step" in r]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
