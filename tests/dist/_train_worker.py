"""One rank of the distributed trainer tests: runs several cases in the same processes (imports
cost ~7 s per process, so cases share them) and writes rank<r>.json with what each case measured.

argv: cases.json out_dir. A case: {name, parallel: {...ParallelConfig}, steps, rows, seq_len,
grad_accum, lr, model: {...ModelConfig}, optim: {...OptimConfig}, logits: bool, lora: {...LoraConfig}
(LoRA cases also measure frozen weights, grads and logits after training: _lora_checks.py),
save_dir: a LoRA case saves a checkpoint there}; a case with `overrides` runs the real
trainer instead (_ckpt_worker.run_case).
"""
from __future__ import annotations

import gc

import _ckpt_worker
import torch
import torch.distributed as dist
from _batches import global_batch, rank_micro_batches
from _lora_checks import LoraProbe
from _rank import serve

from shardtune.config import LoraConfig, ModelConfig, OptimConfig, ParallelConfig
from shardtune.parallel.fsdp import autocast_dtype
from shardtune.parallel.mesh import build_mesh, dp_group, sub_mesh
from shardtune.train.core.metrics import SavedActivations, model_state_bytes
from shardtune.train.core.model import build_model
from shardtune.train.core.optim import build_optimizer, build_scheduler
from shardtune.train.core.step import StepOptions, global_loss, train_step


def run_case(case: dict, rank: int, world: int) -> dict:
    if "overrides" in case:  # a real-trainer case (_ckpt_worker.py), e.g. LoRA resume
        return _ckpt_worker.run_case(case, rank, world)
    pcfg = ParallelConfig(**case["parallel"])
    mesh = build_mesh(pcfg, world, world, "cpu")
    mcfg = ModelConfig(**case.get("model", {}))
    torch.manual_seed(0)
    lora_cfg = LoraConfig(**case["lora"]) if case.get("lora") else None
    model = build_model(mcfg, pcfg, mesh, torch.device("cpu"), seed=case.get("seed", 0), lora_cfg=lora_cfg)
    probe = LoraProbe(model) if lora_cfg else None
    out: dict = {}
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):  # count DDP's gradient all-reduces
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        out["ddp_allreduces"] = 0

        def counting_hook(state, bucket):
            out["ddp_allreduces"] += 1
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting_hook)
    real_all_reduce = dist.all_reduce
    if pcfg.strategy == "hsdp":  # count FSDP2's gradient all-reduces on the replicate group
        replica_group = sub_mesh(mesh, "hsdp")["dp_replicate"].get_group()
        out["replica_allreduces"] = 0

        def counting_all_reduce(tensor, *args, **kwargs):
            # FSDP2 calls dist.all_reduce(reduce_output, group=..., op=...) (_fsdp_collectives.py)
            if kwargs.get("group") is replica_group:
                out["replica_allreduces"] += 1
            return real_all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
    if case.get("logits"):
        ids = global_batch(99, 2, 16)["input_ids"]
        with torch.no_grad():
            out["logits"] = model(input_ids=ids).logits.float().tolist()
    ocfg = OptimConfig(lr=case.get("lr", 1e-3), warmup_steps=0, schedule="constant", grad_clip=1.0,
                       weight_decay=0.0, **case.get("optim", {}))
    opt = build_optimizer(model, ocfg, pcfg, dp_group(mesh))
    sched = build_scheduler(opt, ocfg, case["steps"])
    out["losses"], out["grad_norms"] = [], []
    saved = SavedActivations()
    for step in range(case["steps"]):
        batch = global_batch(step if not case.get("same_batch") else 0, case["rows"], case["seq_len"])
        mbs = rank_micro_batches(batch, rank, world, case.get("grad_accum", 1))
        r = train_step(model, opt, sched, mbs, StepOptions(autocast_dtype=autocast_dtype(pcfg)), dp_group=None,
                       dp_size=world, activations=saved if step == 0 else None)
        out["losses"].append(global_loss(r))
        out["grad_norms"].append(float(r.grad_norm))
        if step == 0:
            out["bytes"] = model_state_bytes(model, opt)
            out["activations_bytes"] = saved.peak_bytes
            if probe:
                out.update(probe.after_first_step(model))
    dist.all_reduce = real_all_reduce
    if probe:
        out.update(probe.finish(model, opt, sched, case, rank, world))
    del model, opt, sched
    gc.collect()
    return out


if __name__ == "__main__":
    serve(run_case)
