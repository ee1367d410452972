"""LoRA measurements for the trainer worker (_train_worker.py): frozen base weights before/after,
which parameters got gradients, logits after training, and a checkpoint for the export tests."""
from __future__ import annotations

from pathlib import Path

import torch
from _batches import global_batch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class LoraProbe:
    def __init__(self, model: torch.nn.Module) -> None:
        from shardtune.train.core.model import unwrap

        self.frozen = {n: _local(p).detach().clone() for n, p in unwrap(model).named_parameters()
                       if not p.requires_grad}

    def after_first_step(self, model) -> dict:
        from shardtune.train.core.model import unwrap

        # train_step zeroes grads at its start, so the first step's grads are still here
        return {"grad_params": sorted(n for n, p in unwrap(model).named_parameters() if p.grad is not None),
                "trainable_params": sorted(n for n, p in unwrap(model).named_parameters() if p.requires_grad)}

    def finish(self, model, opt, sched, case: dict, rank: int, world: int) -> dict:
        from shardtune.train.core.model import unwrap

        params = dict(unwrap(model).named_parameters())
        change = max(float((_local(params[n]).detach() - v).abs().max()) for n, v in self.frozen.items())
        out = {"frozen_max_change": change, "num_frozen": len(self.frozen)}
        ids = global_batch(99, 2, 16)["input_ids"]
        with torch.no_grad():
            out["logits_after"] = model(input_ids=ids).logits.float().tolist()
        if case.get("save_dir"):
            from shardtune.train.core.step import TrainState
            from shardtune.train.durable.checkpoint import save_checkpoint

            save_checkpoint(Path(case["save_dir"]), case["steps"], model, opt, sched, TrainState(),
                            rank=rank, world_size=world, strategy=case["parallel"]["strategy"],
                            cfg_hash="test", keep=1, run_id="lora-test",
                            hf_files=lambda folder: unwrap(model).config.save_pretrained(folder))
        return out
