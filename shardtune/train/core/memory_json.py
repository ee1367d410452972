"""memory.json read back: the largest bytes over ranks per planner key, as the train summary
and `shardtune report` both print them. Imports no torch (`report` stays light)."""
from __future__ import annotations

# memory.json's name of each planner key (plan/memory.py) the trainer counts itself; the tracker's
# step (CPU) has every planner key, buffers and the optimizer's temporaries too
MEASURED_KEYS = {"params": "params_bytes", "grads": "grads_bytes", "optimizer": "optimizer_bytes",
                 "activations": "activations_bytes", "total": "peak_bytes"}
MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "buffers", "optimizer_step_temp", "total")


def measured_memory(per_rank: list[dict]) -> tuple[dict[str, int], str]:
    """(the largest bytes over ranks per planner key, how they were measured): the memory
    tracker's step where every rank recorded one (CPU), else the trainer's counts (on CUDA
    `peak_bytes` is max_memory_allocated). The train summary and `shardtune report` both read it."""
    ranks = [r for r in per_rank if r]
    if not ranks:
        return {}, "no rank recorded memory"
    out = {k: max(r.get(m, 0) for r in ranks) for k, m in MEASURED_KEYS.items()}
    tracked = [r["tracked"] for r in ranks if isinstance(r.get("tracked"), dict)]
    if len(tracked) == len(ranks):
        # a key a rank's tracker did not measure (torchao's step: no optimizer_step_temp) stays out
        out.update({k: max(t[k] for t in tracked) for k in MEMORY_KEYS if all(k in t for t in tracked)})
        return out, "torch's memory tracker, one step"
    return out, "the run's last logged step"
