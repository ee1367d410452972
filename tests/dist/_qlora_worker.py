"""QLoRA cases for tests/dist/test_qlora.py, on gloo ranks: the trainer's build (train/core/model.py
build_model with lora.quantize_base nf4), optimizer and train_step over the shared global batches.
Per case: the global losses, and this rank's parameter bytes measured from the storages themselves
(an NF4Tensor's inner tensors through torchao's `__tensor_flatten__`, a DTensor's local part)."""
from __future__ import annotations

import gc

import torch
from _batches import global_batch, rank_micro_batches
from _rank import serve

from shardtune.config import LoraConfig, ModelConfig, OptimConfig, ParallelConfig
from shardtune.parallel.fsdp import autocast_dtype
from shardtune.parallel.mesh import build_mesh, dp_group
from shardtune.train.core.metrics import storages
from shardtune.train.core.model import build_model, unwrap
from shardtune.train.core.optim import build_optimizer, build_scheduler
from shardtune.train.core.step import StepOptions, global_loss, train_step


def param_bytes(model) -> dict:
    seen, nf4 = {}, 0
    for p in unwrap(model).parameters():
        local = getattr(p, "_local_tensor", p.data)
        nf4 += type(local).__name__ == "NF4Tensor"
        for s in storages(local):
            seen[s.data_ptr()] = s.nbytes()
    return {"params_bytes": sum(seen.values()), "nf4_params": nf4}


def run_case(case: dict, rank: int, world: int) -> dict:
    pcfg = ParallelConfig(**case["parallel"])
    mesh = build_mesh(pcfg, world, world, "cpu")
    torch.manual_seed(0)
    model = build_model(ModelConfig(**case["model"]), pcfg, mesh, torch.device("cpu"), seed=0,
                        lora_cfg=LoraConfig(**case["lora"]))
    out = param_bytes(model)
    ocfg = OptimConfig(lr=case["lr"], warmup_steps=0, schedule="constant", grad_clip=1.0, weight_decay=0.0)
    opt = build_optimizer(model, ocfg, pcfg, dp_group(mesh))
    sched = build_scheduler(opt, ocfg, case["steps"])
    out["losses"] = []
    for step in range(case["steps"]):
        mbs = rank_micro_batches(global_batch(step, case["rows"], case["seq_len"]), rank, world, 1)
        r = train_step(model, opt, sched, mbs, StepOptions(autocast_dtype=autocast_dtype(pcfg)), dp_group=None,
                       dp_size=world)
        out["losses"].append(global_loss(r))
    out["grad_params"] = sorted(n for n, p in unwrap(model).named_parameters() if p.grad is not None)
    del model, opt, sched
    gc.collect()
    return out


if __name__ == "__main__":
    serve(run_case)
