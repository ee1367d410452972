"""Pipeline parallelism's schedule rules (parallel.pp, pp_schedule, pp_virtual_stages): one function
for the planner (plan/validate.py) and the launcher (launch/checks.py), so they refuse alike; where the
stages sit is layout.check_pp_placement's. Why: docs/parallelism.md "Pipeline parallelism". Imports
no torch."""
from __future__ import annotations

from shardtune.errors import UserError

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")


def check_pp_schedule(pp: int, schedule: str, virtual_stages: int, microbatches: int) -> None:
    """A known schedule; virtual stages with interleaved-1f1b only (2 or more); at least pp
    micro-batches (train.grad_accum) for the 1F1B schedules (torch's Schedule1F1B refuses fewer)."""
    if schedule not in SCHEDULES:
        raise UserError(f"parallel.pp_schedule {schedule!r} (--pp-schedule) is not one of {', '.join(SCHEDULES)}")
    if pp == 1:
        return
    if (schedule == "interleaved-1f1b") != (virtual_stages > 1):
        raise UserError(f"parallel.pp_schedule {schedule} with pp_virtual_stages {virtual_stages} "
                        "(--pp-virtual-stages): interleaved-1f1b takes 2 or more virtual stages per rank, the "
                        "others exactly 1")
    if schedule != "gpipe" and microbatches < pp:
        raise UserError(f"train.grad_accum {microbatches} micro-batches (--grad-accum) < pp {pp}: {schedule} needs "
                        f"at least one micro-batch per stage (torch's Schedule1F1B refuses fewer); give a grad_accum "
                        f">= {pp}")
