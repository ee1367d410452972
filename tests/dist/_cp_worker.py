"""One rank of the context-parallel tests (tests/dist/test_cp.py): several cases in the same
processes, rank<r>.json with what each measured. argv: cases.json out_dir.

A case: {name, parallel: {...ParallelConfig with cp (and tp)}, model: {...ModelConfig}, lora, steps,
rows, seq_len, grad_accum, lr, loss_chunks, logits: bool, compile: bool (train.compile), vary_docs:
bool}. Each rank takes its data-parallel share of
`_batches.global_batch` (the ranks of one cp and tp group the same rows) and the trainer's step
splits the sequence; `logits` also records the full logits of two batches that differ in one
document only (the cp group's pieces all-gathered), for the document-isolation test; `vary_docs`
steps on `varied_documents` instead; every case records dynamo's graph count before and after.
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch._dynamo.utils as dynamo_utils
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _batches import global_batch, rank_micro_batches  # noqa: E402
from _rank import build_case, process_group, write_result  # noqa: E402

from shardtune.parallel.cp import cp_degree, shard_batch  # noqa: E402
from shardtune.parallel.fsdp import autocast_dtype  # noqa: E402
from shardtune.parallel.mesh import cp_mesh  # noqa: E402
from shardtune.parallel.tp import tp_degree  # noqa: E402
from shardtune.train.core.metrics import SavedActivations  # noqa: E402
from shardtune.train.core.step import StepOptions, train_step  # noqa: E402


def changed_document_batches(rows: int, seq_len: int) -> tuple[dict, dict]:
    """Two batches equal but for the tokens of the first document of row 0 (`_batches`' rows hold
    two documents, the second from seq_len // 2); the first batch is step 0's."""
    a = global_batch(0, rows, seq_len)
    b = {k: v.clone() for k, v in a.items()}
    b["input_ids"][0, :seq_len // 2] = (b["input_ids"][0, :seq_len // 2] + 7) % 256
    return a, b


def varied_documents(step: int, rows: int, seq_len: int) -> dict:
    """`global_batch`'s tokens with document boundaries that move from step to step and row to row
    (one or two a row): what real packed data does, and what made compiled cp layers recompile."""
    batch = global_batch(step, rows, seq_len)
    idx = torch.arange(seq_len)
    for r in range(rows):
        cuts = [3 + (5 * step + 7 * r) % (seq_len // 2)] + ([seq_len // 2 + 3 + step] if (step + r) % 2 else [])
        starts = torch.zeros(seq_len, dtype=torch.long)
        starts[cuts] = idx[cuts]
        batch["position_ids"][r] = idx - starts.cummax(0).values  # positions restart at each cut
        batch["labels"][r, [c - 1 for c in cuts]] = -100  # never predict across a boundary
    return batch


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompile adds one)."""
    return int(dynamo_utils.counters["stats"]["unique_graphs"])


def full_logits(model, batch: dict, mesh) -> list:
    """The logits of `batch` (every rank the whole batch), the cp group's row pieces all-gathered."""
    with torch.no_grad():
        local = shard_batch(model, batch)
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        cpm = cp_mesh(mesh)
        if cpm is not None:
            parts = [torch.empty_like(logits) for _ in range(cpm.size())]
            dist.all_gather(parts, logits.contiguous(), group=cpm.get_group())
            logits = torch.cat(parts, dim=1)
    return logits[:, :batch["input_ids"].shape[1]].tolist()


def run_case(case: dict, rank: int, world: int) -> dict:
    pcfg, mesh, dp_rank, dp_size, group, model, opt, sched = build_case(case, world)
    cp, tp = cp_degree(model), tp_degree(model)
    opts = StepOptions(autocast_dtype=autocast_dtype(pcfg), loss_chunks=case.get("loss_chunks"))
    out: dict = {"losses": [], "grad_norms": [], "dp_rank": dp_rank, "dp_size": dp_size, "cp": cp, "tp": tp,
                 "graphs_before": graphs()}
    if case.get("logits"):
        out["logits"] = [full_logits(model, b, mesh) for b in changed_document_batches(2, case["seq_len"])]
    acts = SavedActivations()
    for step in range(case["steps"]):
        batch = (varied_documents if case.get("vary_docs") else global_batch)(step, case["rows"], case["seq_len"])
        mbs = rank_micro_batches(batch, dp_rank, dp_size, case.get("grad_accum", 1))
        # the step as the trainer calls it (train/rank/loop.py): tokens counted over dp, grads x dp x cp
        r = train_step(model, opt, sched, mbs, opts, dp_group=group, dp_size=dp_size * cp,
                       activations=acts if step == 0 else None)
        total = r.loss_part.detach().clone()
        dist.all_reduce(total)  # every rank's part; the ranks of a tp group hold the same one
        out["losses"].append(float(total) / tp)
        out["grad_norms"].append(float(r.grad_norm))
    out["activation_bytes"] = acts.peak_bytes
    out["graphs_after"] = graphs()
    del model, opt, sched
    gc.collect()
    return out


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    results = {}
    with process_group() as (rank, world):
        for case in cases:
            results[case["name"]] = run_case(case, rank, world)
            dist.barrier()
    write_result(out_dir, rank, results)


if __name__ == "__main__":
    main()
