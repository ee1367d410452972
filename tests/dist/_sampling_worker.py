"""One rank of tests/dist/test_sharded_sampling.py: generate_ids on a zero3-sharded model of the cut SmolLM2
fixture, every rank in lockstep with the same prompt. argv: folder prompt.json out_dir; prompt.json
holds {ids, max_new_tokens, stop_ids}. Writes rank<r>.json: the greedy and a sampled answer."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from _rank import process_group, write_result

from shardtune.config import ModelConfig, ParallelConfig
from shardtune.parallel.apply import build_mesh
from shardtune.train.core.model import build_model
from shardtune.train.core.sampling import generate_ids


def main() -> None:
    folder, spec, out_dir = sys.argv[1], json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
    with process_group() as (rank, world):
        out = _run(folder, spec, rank, world)
    write_result(out_dir, rank, out)


def _run(folder, spec, rank, world) -> dict:
    pcfg = ParallelConfig(strategy="zero3", precision="fp32")
    mesh = build_mesh(pcfg, world, world, "cpu")
    model = build_model(ModelConfig(name=folder), pcfg, mesh, torch.device("cpu"), seed=0)
    model.train()
    kw = dict(max_new_tokens=spec["max_new_tokens"], stop_ids=spec["stop_ids"])
    greedy = generate_ids(model, spec["ids"], **kw)
    sampled = generate_ids(model, spec["ids"], temperature=0.9, top_p=0.9, seed=3, **kw)
    out = {"greedy": greedy, "sampled": sampled, "training_after": model.training}
    return out


if __name__ == "__main__":
    main()
