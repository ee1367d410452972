"""The evaluations of a run in a few lines, read back from its folder (no torch): val_loss first →
last (metrics.jsonl) and the last evaluation's sample answers (samples.jsonl). One rule for the
end-of-run summary (metrics.py) and `shardtune report`."""
from __future__ import annotations

import json
from pathlib import Path

ANSWER_CHARS = 100  # an answer longer than this is cut, with "…"


def _jsonl(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file; a line cut by a kill (or not an object) is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _one_line(text: str, most: int = ANSWER_CHARS) -> str:
    text = json.dumps(text, ensure_ascii=False)[1:-1]  # line breaks and quotes escaped: one line each
    return text if len(text) <= most else text[:most] + "…"


def eval_lines(run_dir: Path, records: list[dict] | None = None) -> list[str]:
    """["val_loss A (step i) → B (step j)", "samples at step j:", '  "prompt" → "answer"', ...]."""
    run_dir = Path(run_dir)
    records = _jsonl(run_dir / "metrics.jsonl") if records is None else records
    vals = [r for r in records if isinstance(r.get("val_loss"), (int, float))]
    lines = []
    if vals:
        first, last = vals[0], vals[-1]
        lines.append(f"val_loss {first['val_loss']:.4f} (step {first['step']})" + (
            f" → {last['val_loss']:.4f} (step {last['step']})" if last is not first else ""))
    samples = [s for s in _jsonl(run_dir / "samples.jsonl") if "prompt" in s and "completion" in s]
    if samples:
        step = samples[-1].get("step")
        lines.append(f"samples at step {step} (samples.jsonl):")
        lines += [f'  "{_one_line(s["prompt"], 60)}" → "{_one_line(s["completion"])}"'
                  for s in samples if s.get("step") == step]
    return lines
