"""adamw-8bit on gloo ranks (tests/dist/test_adamw8bit.py): tiny-llama under a strategy, a few steps
with torchao's AdamW8bit (FSDP) or bitsandbytes' (ddp), and each state's real storage bytes: an
OptimState8bit's codes, scales and qmap counted from its own inner tensors (__tensor_flatten__)."""
from __future__ import annotations

import gc

import torch
from _batches import global_batch, rank_micro_batches
from _rank import serve

from shardtune.config import ModelConfig, OptimConfig, ParallelConfig
from shardtune.parallel.fsdp import autocast_dtype
from shardtune.parallel.mesh import build_mesh, dp_group
from shardtune.train.core.metrics import storages
from shardtune.train.core.model import build_model
from shardtune.train.core.optim import build_optimizer, build_scheduler
from shardtune.train.core.step import StepOptions, global_loss, train_step


def state_bytes(opt) -> dict[str, int]:
    inner = getattr(opt, "optim", opt)
    dev, host = {}, {}
    for state in inner.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                for s in storages(v):
                    (host if k == "step" else dev)[s.data_ptr()] = s.nbytes()
    return {"optimizer": sum(dev.values()), "step_counters": sum(host.values()),
            "quantised_states": sum(type(local).__name__ == "OptimState8bit" for st in inner.state.values()
                                    for v in st.values() for local in [v.to_local() if hasattr(v, "to_local") else v])}


def run_case(case: dict, rank: int, world: int) -> dict:
    pcfg = ParallelConfig(**case["parallel"])
    mesh = build_mesh(pcfg, world, world, "cpu")
    torch.manual_seed(0)
    model = build_model(ModelConfig(), pcfg, mesh, torch.device("cpu"), seed=0)
    ocfg = OptimConfig(lr=case["lr"], warmup_steps=0, schedule="constant", grad_clip=1.0, weight_decay=0.0,
                       name=case["optimizer"])
    opt = build_optimizer(model, ocfg, pcfg, dp_group(mesh))
    sched = build_scheduler(opt, ocfg, case["steps"])
    out: dict = {"losses": []}
    for step in range(case["steps"]):
        batch = global_batch(step, case["rows"], case["seq_len"])
        r = train_step(model, opt, sched, rank_micro_batches(batch, rank, world, 1),
                       StepOptions(autocast_dtype=autocast_dtype(pcfg)), dp_group=None, dp_size=world)
        out["losses"].append(global_loss(r))
        if step == 0:
            out["bytes"] = state_bytes(opt)
    del model, opt, sched
    gc.collect()
    return out


if __name__ == "__main__":
    serve(run_case, timeout_s=120)
