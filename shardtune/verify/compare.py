"""Differences between predicted, simulated and measured memory, as numbers and as rich tables.

Keys are the planner's `Memory` keys (plan/strategy_plan.py); measured runs use the trainer's
memory.json names (`params_bytes`, ..., `peak_bytes`: train/rank/main.py). GiB = 2^30 bytes,
MiB = 2^20 bytes. Imports no torch.
"""
from __future__ import annotations

from rich import box
from rich.measure import Measurement
from rich.table import Table

from shardtune.plan.report import make_console
from shardtune.train.core.memory_json import MEASURED_KEYS, MEMORY_KEYS  # noqa: F401  (report reads both here)
from shardtune.train.core.memory_json import measured_memory as _measured_memory
from shardtune.verify.trace_inputs import mark_untraced  # noqa: F401  (plan --simulate marks here, torch-free)

LABELS = {"params": "params", "grads": "grads", "optimizer": "optim", "activations": "activ",
          "buffers": "buffers", "optimizer_step_temp": "opt tmp", "reference": "ref", "total": "peak"}
GIB = 2**30
MIB = 2**20


def relative_diff(value: float | None, reference: float | None) -> float | None:
    """(value − reference) / reference, None when either is missing or the reference is 0."""
    if value is None or not reference:
        return None
    return (value - reference) / reference


def fmt_pct(d: float | None, compact: bool = False) -> str:
    """+6.1%; compact: no decimal from ±1,000 % on (a cell stays 7 characters)."""
    if d is None:
        return "—"
    return f"{d * 100:+.0f}%" if compact and abs(d) >= 9.9995 else f"{d * 100:+.1f}%"


def differences(reference: dict, other: dict, keys=MEMORY_KEYS) -> dict[str, float | None]:
    """Per key: (other − reference) / reference."""
    return {k: relative_diff(other.get(k), reference.get(k)) for k in keys}


def measured_memory(memory_json: dict) -> dict[str, int]:
    """The largest bytes over ranks per planner key from a run's memory.json, read as the train
    summary reads it (train/core/memory_json.py)."""
    return _measured_memory(memory_json.get("per_rank", []))[0]


def _fmt(n: int | None, unit: int, digits: int = 2) -> str:
    return "—" if n is None else f"{n / unit:,.{digits}f}"


# compact labels (consoles narrower than the full table): Δ a/b = (a − b) / b
COMPACT_SOURCES = {"Δ measured vs predicted": "Δ meas/pred", "Δ measured vs simulated": "Δ meas/sim",
                   "Δ simulated vs predicted": "Δ sim/pred", "Δ sim vs analytic": "Δ sim/anal"}


class MemoryTable:
    """One row per (strategy, source, memory dict); a source 'Δ ...' row holds relative
    differences. Drawn whole where the console has room, else compact (strategy before the
    source, short Δ labels, one decimal): no cell is cut at 80 columns."""

    def __init__(self, title: str, rows: list[tuple[str, str, dict]], unit: int = GIB, keys=MEMORY_KEYS) -> None:
        self.title, self.rows, self.unit, self.keys = title, rows, unit, keys

    def table(self, compact: bool):
        title = self.title + ("; Δ a/b = (a − b) / b" if compact else "")
        table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=compact)
        for col in ((() if compact else ("strategy",)) + ("source",) + tuple(LABELS[k] for k in self.keys)):
            table.add_column(col, justify="left" if col in ("strategy", "source") else "right", no_wrap=True)
        big = max((abs(v.get(k) or 0) for _, src, v in self.rows if not src.startswith("Δ") for k in self.keys),
                  default=0) >= 9999.95 * self.unit
        for name, source, values in self.rows:
            if source.startswith("Δ"):
                cells = [fmt_pct(values.get(k), compact) for k in self.keys]
            else:
                cells = [_fmt(values.get(k), self.unit, (0 if big else 1) if compact else 2) for k in self.keys]
            if compact:
                label = COMPACT_SOURCES.get(source, source.split(" (")[0])
                table.add_row(f"{name} {label}".strip(), *cells)
            else:
                table.add_row(name, source, *cells)
        return table

    def __rich_console__(self, console, options):
        full = self.table(compact=False)
        natural = Measurement.get(console, options.update(max_width=10_000), full).maximum  # unclamped
        fits = natural <= options.max_width
        yield full if fits else self.table(compact=True)


def memory_table(title: str, rows: list[tuple[str, str, dict]], unit: int = GIB, keys=MEMORY_KEYS) -> MemoryTable:
    """The rich renderable of `MemoryTable` (plan --simulate, report)."""
    return MemoryTable(title, rows, unit, keys)


def render_simulated(result, console=None) -> None:
    """`plan --simulate`: analytic, simulated and their difference per strategy and category."""
    console = console or make_console(140)
    peak = max((sp.memory.total for sp in result.strategies), default=0)
    unit, unit_name = (GIB, "GiB (2^30 bytes)") if peak >= GIB else (MIB, "MiB (2^20 bytes)")
    rows = []
    notes = []
    # dpo's frozen reference copy (plan/preference.py), a column where a plan holds one
    keys = (*MEMORY_KEYS[:-1], "reference", "total") if any(sp.memory.reference for sp in result.strategies) \
        else MEMORY_KEYS
    for sp in result.strategies:
        analytic = {k: getattr(sp.memory, k) for k in keys}
        sim = sp.simulated or {}
        rows.append((sp.name, "analytic", analytic))
        if sim.get("status") == "traced":
            rows.append(("", f"simulated ({sim.get('wall_s', 0):.0f} s)", sim))
            rows.append(("", "Δ sim vs analytic", differences(analytic, sim, keys)))
        else:
            notes.append(f"{sp.name}: analytic only (not traced: {sim.get('reason', 'no simulation')})")
    console.print(memory_table(f"Analytic vs simulated per-GPU memory, {unit_name}; "
                               "Δ = (simulated − analytic) / analytic", rows, unit, keys))
    console.print("simulated: the trainer's step traced on fake CPU tensors with a fake process group "
                  "(FSDPMemTracker / MemTracker, rank 0); see docs/calibration.md")
    for n in notes:
        console.print(f"note: {n}")
