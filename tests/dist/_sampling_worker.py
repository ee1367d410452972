"""One rank of tests/dist/test_sharded_sampling.py: generate_ids on a zero3-sharded model of the cut SmolLM2
fixture, every rank in lockstep with the same prompt. argv: folder prompt.json out_dir; prompt.json
holds {ids, max_new_tokens, stop_ids}. Writes rank<r>.json: the greedy and a sampled answer."""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from shardtune.config import ModelConfig, ParallelConfig
from shardtune.parallel.apply import build_mesh
from shardtune.train.core.model import build_model
from shardtune.train.core.sampling import generate_ids


def main() -> None:
    folder, spec, out_dir = sys.argv[1], json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    pcfg = ParallelConfig(strategy="zero3", precision="fp32")
    mesh = build_mesh(pcfg, world, world, "cpu")
    model = build_model(ModelConfig(name=folder), pcfg, mesh, torch.device("cpu"), seed=0)
    model.train()
    kw = dict(max_new_tokens=spec["max_new_tokens"], stop_ids=spec["stop_ids"])
    greedy = generate_ids(model, spec["ids"], **kw)
    sampled = generate_ids(model, spec["ids"], temperature=0.9, top_p=0.9, seed=3, **kw)
    out = {"greedy": greedy, "sampled": sampled, "training_after": model.training}
    dist.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
