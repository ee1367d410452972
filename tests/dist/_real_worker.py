"""One rank of tests/dist/test_real_model.py: shardtune's own data path and trainer on the cut
SmolLM2 fixture. A case (`_rank.serve`): {name, folder, data: a chat .jsonl}; it measures the
step-1 loss of zero3 fp32 (2 rows per rank, no packing, no shuffle) and the dtypes of the
optimizer-owned parameter shards under bf16-mixed."""
from __future__ import annotations

import torch
import torch.distributed as dist
from _rank import serve

from shardtune.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from shardtune.parallel.fsdp import autocast_dtype
from shardtune.parallel.mesh import build_mesh, dp_group
from shardtune.train.core.model import build_model
from shardtune.train.core.optim import build_optimizer, build_scheduler
from shardtune.train.core.step import StepOptions, global_loss, train_step
from shardtune.train.data.dataset import build_dataloader, build_tokenizer


def run_case(case: dict, rank: int, world: int) -> dict:
    return _run(case["folder"], case["data"], rank, world)


def _run(folder, data, rank, world) -> dict:
    out: dict = {}
    dcfg = DataConfig(path=data, packing=False, shuffle=False)
    tcfg = TrainConfig(seq_len=64, micro_batch=2, grad_accum=1)
    tok = build_tokenizer(dcfg, folder)
    batch = next(build_dataloader(dcfg, tcfg, tok, rank, world, seed=0))
    ocfg = OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant", grad_clip=1.0, weight_decay=0.0)
    for precision in ("fp32", "bf16-mixed"):
        pcfg = ParallelConfig(strategy="zero3", precision=precision)
        mesh = build_mesh(pcfg, world, world, "cpu")
        model = build_model(ModelConfig(name=folder), pcfg, mesh, torch.device("cpu"), seed=0)
        opt = build_optimizer(model, ocfg, pcfg, dp_group(mesh))
        sched = build_scheduler(opt, ocfg, 1)
        r = train_step(model, opt, sched, [batch], StepOptions(autocast_dtype=autocast_dtype(pcfg)), dp_group=None,
                       dp_size=world)
        owned = [p for g in opt.param_groups for p in g["params"]]
        out[precision] = {"loss": global_loss(r), "target_tokens": int(r.num_tokens),
                          "param_dtypes": sorted({str(p.to_local().dtype if hasattr(p, "to_local") else p.dtype)
                                                  for p in owned}),
                          "state_dtypes": sorted({str(v.to_local().dtype if hasattr(v, "to_local") else v.dtype)
                                                  for s in opt.state.values() for k, v in s.items()
                                                  if k != "step" and torch.is_tensor(v)})}
        dist.barrier()
        del model, opt
    return out


if __name__ == "__main__":
    serve(run_case)
