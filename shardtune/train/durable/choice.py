"""Which checkpoint a run resumes: one function of the run folder and `checkpoint.resume`, torch-free,
called by the launcher (train/launcher/rerun.py, before any process starts) and by rank 0 (keeper.resume);
the launcher hands its choice to the ranks (`CHOICE_ENV`), which only verify checksums on top and
fall back along the same list (docs/checkpoints.md "Which checkpoint a resume loads").

The rule: `never` → none. A path → that checkpoint (its damage is an error, not a fallback). `auto`
→ the complete checkpoints, newest saved first, each checked by a stat of every file against its
recorded size and its shards against `.metadata` (shards.damage, sizes only): the first clean one
is resumed, the ones before it are skipped with why (a `.metadata` cut short is damage, so both
sides pass over it); the clean older ones are the fallbacks if a checksum then fails on a rank.

A `step_<N>` folder whose metadata records another step (say `step_250` copied in as `step_4`)
is never resumed, deleted or overwritten: it is named in one line; a save of step N moves it
aside first (checkpoint.py `_swap_in`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardtune.train.durable import shards
from shardtune.train.durable.ckpt_files import (
    CheckpointInfo,
    checkpoints_dir,
    complete_checkpoints,
    read_info,
    resolve_resume,
)

CHOICE_ENV = "SHARDTUNE_RESUME_CHOICE"  # the launcher's chosen checkpoint path ("none": a fresh start)


@dataclass(frozen=True)
class Choice:
    candidates: tuple[CheckpointInfo, ...]  # the one to resume, then (auto) the clean older ones
    skipped: tuple[tuple[Path, str], ...] = ()  # newer ones passed over, and why
    misnamed: tuple[tuple[Path, str], ...] = ()  # step_<N> folders recording another step

    @property
    def chosen(self) -> CheckpointInfo | None:
        return self.candidates[0] if self.candidates else None

    def lines(self) -> list[str]:
        """One line per checkpoint passed over, saying why."""
        out = [f"shardtune: skipping {p}: {why}; resuming an older checkpoint" for p, why in self.skipped]
        return out + [f"shardtune: {p} {why}; it is not resumed and never overwritten (rename it to resume it)"
                      for p, why in self.misnamed]

    def handed_on(self, path: str | None) -> Choice:
        """The ranks' copy, starting at the launcher's choice `path` (None: not launched by it; "none":
        a fresh start). A `path` this list does not hold (the folder changed since): unchanged."""
        if path is None:
            return self
        if path == "none":
            return Choice((), self.skipped, self.misnamed)
        paths = [str(i.path) for i in self.candidates]
        return Choice(self.candidates[paths.index(path):], self.skipped, self.misnamed) if path in paths else self


def misnamed_checkpoints(run_dir: Path) -> list[tuple[Path, str]]:
    """`step_<N>` folders holding a complete checkpoint of another step, and what they record."""
    d = checkpoints_dir(run_dir)
    out = []
    for p in sorted(d.glob("step_*")) if d.is_dir() else []:
        info = read_info(p)
        if info is not None and p.name != f"step_{info.step}":
            out.append((p, f"holds a checkpoint of step {info.step}, not of its name's step"))
    return out


def choose_checkpoint(run_dir: Path, ckpt_cfg) -> Choice:
    """The checkpoint `ckpt_cfg.resume` resumes in `run_dir`, the fallbacks, and those passed over
    (module docstring). Reads the folder, writes nothing. A `.metadata` that names a global DCP never
    needs is a UserError (tampering), not a fallback."""
    misnamed = tuple(misnamed_checkpoints(run_dir))
    how = ckpt_cfg.resume
    if how == "never":
        return Choice((), (), misnamed)
    if how != "auto":
        return Choice((resolve_resume(ckpt_cfg, run_dir),), (), misnamed)
    clean, skipped = [], []
    for info in reversed(complete_checkpoints(run_dir)):
        bad = shards.damage(info, sizes_only=True)
        if not bad:
            clean.append(info)
        elif not clean:
            skipped.append((info.path, bad[0] + (f" (and {len(bad) - 1} more)" if bad[1:] else "")))
    return Choice(tuple(clean), tuple(skipped), misnamed)
