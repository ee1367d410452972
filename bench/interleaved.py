"""shardtune's whole training loop against the hand-written FSDP2 loop, both in the same ranks,
their steps alternated: the in-process mode of bench/throughput.py (`--mode interleaved`).

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/interleaved.py SPEC.json

SPEC.json (written by bench/throughput.py): the recipe, the peers' spec (model, data, seq_len…),
the strategy, `log_every` and `out`. Both sides are built in every rank before any step:
  shardtune  `train.rank.loop.set_up` on the recipe, then `train.rank.loop.iterate`: each `next()` is one
             pass of the real loop (batch fetch, train_step, the keeper's per-step checks, the
             metrics line and progress bar on logged steps), nothing left out
  limit      bench/peer_loops.py's tutorial step on the same rows (shardtune's loader's rows)
One step of each is timed between barriers (so a rank's wait for the other is inside the
measurement of the side that caused it); the order alternates (A B, B A, …) so the load of a
shared machine hits both alike. Rank 0 writes {"hand_s": [...], "shardtune_s": [...]} to
`out/interleaved.json`; the ratio per step pair is hand time / shardtune time (> 1: shardtune
faster), the driver takes the median.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_loops import IGNORE_INDEX, build_model, rank_batches  # noqa: E402


def hand_side(spec: dict, rank: int, world: int, steps: int):
    """The limit's step as a closure over its own model, optimizer and rows."""
    from torch.distributed.fsdp import fully_shard

    batches = iter(rank_batches(spec, rank, world, steps)[rank])
    model = build_model(spec)
    model.train()
    reshard = spec["strategy"] == "zero3"
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95), weight_decay=0.0)

    def step() -> None:
        b = next(batches)
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE_INDEX)
        del logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        loss.item()

    return step


def shardtune_side(spec: dict):
    """The real loop, one pass per call (train/rank/loop.py's iterate generator)."""
    from shardtune.config import load_recipe
    from shardtune.train.rank.loop import iterate, set_up
    from shardtune.train.rank.main import setup_distributed

    cfg = load_recipe(spec["recipe"], [f"parallel.strategy={spec['strategy']}", f"output_dir={spec['out']}",
                                       f"train.log_every={spec['log_every']}"])
    ctx = setup_distributed(cfg)
    run = set_up(cfg, ctx, Path(cfg.run_dir), None)
    gen = iterate(run)
    return ctx, (lambda: next(gen))


def timed(step) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - t0


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    ctx, ours = shardtune_side(spec)  # initialises the process group
    steps = spec["steps"]
    hand = hand_side(spec, ctx.rank, ctx.world_size, steps)
    hand_s, ours_s = [], []
    for i in range(steps):
        if i % 2 == 0:
            h, o = timed(hand), timed(ours)
        else:
            o, h = timed(ours), timed(hand)
        hand_s.append(h)
        ours_s.append(o)
    if ctx.rank == 0:
        (Path(spec["out"]) / "interleaved.json").write_text(json.dumps({"hand_s": hand_s, "shardtune_s": ours_s}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
