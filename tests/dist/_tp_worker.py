"""One rank of the tensor-parallel tests (tests/dist/test_tp.py): several cases in the same processes,
rank<r>.json with what each measured. argv: cases.json out_dir.

A case: {name, parallel: {...ParallelConfig with tp}, model: {...ModelConfig}, lora: {...LoraConfig},
steps, rows, seq_len, grad_accum, lr, comm: bool}.
Each rank takes its data-parallel share of `_batches.global_batch` (ranks of one TP group the same
rows); `comm` counts one step's collectives with torch's CommDebugMode.
"""
from __future__ import annotations

import gc

from _batches import global_batch, rank_micro_batches
from _rank import build_case, serve

from shardtune.parallel.fsdp import autocast_dtype
from shardtune.parallel.mesh import tp_mesh
from shardtune.train.core.metrics import model_state_bytes
from shardtune.train.core.step import StepOptions, global_loss, train_step


def run_case(case: dict, rank: int, world: int) -> dict:
    pcfg, mesh, dp_rank, dp_size, group, model, opt, sched = build_case(case, world)
    opts = StepOptions(autocast_dtype=autocast_dtype(pcfg))  # grad clip 1.0, loss chunks from the vocabulary
    out: dict = {"losses": [], "grad_norms": [], "dp_rank": dp_rank, "dp_size": dp_size}
    for step in range(case["steps"]):
        batch = global_batch(step, case["rows"], case["seq_len"])
        mbs = rank_micro_batches(batch, dp_rank, dp_size, case.get("grad_accum", 1))
        counting = case.get("comm") and step == 1  # a step after the first: states exist
        if counting:
            from _comm_count import CommCounter

            labels = {tp_mesh(mesh).get_group().group_name: "tp"}
            if group is not None:
                labels[group.group_name] = "dp"
            mode = CommCounter(labels)
            with mode:
                r = train_step(model, opt, sched, mbs, opts, dp_group=group, dp_size=dp_size)
            out["comm"] = mode.result()
        else:
            r = train_step(model, opt, sched, mbs, opts, dp_group=group, dp_size=dp_size)
        out["losses"].append(global_loss(r, group))
        out["grad_norms"].append(float(r.grad_norm))
        if step == 0:
            out["bytes"] = model_state_bytes(model, opt)
    del model, opt, sched
    gc.collect()
    return out


if __name__ == "__main__":
    serve(run_case)
