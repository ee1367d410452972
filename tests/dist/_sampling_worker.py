"""One rank of tests/dist/test_sharded_sampling.py: generate_ids on a zero3-sharded model of the cut SmolLM2
fixture, every rank in lockstep with the same prompt. A case (`_rank.serve`): {name, folder, prompt:
a json file holding {ids, max_new_tokens, stop_ids}}; it measures the greedy and a sampled answer."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from _rank import serve

from shardtune.config import ModelConfig, ParallelConfig
from shardtune.parallel.mesh import build_mesh
from shardtune.train.core.model import build_model
from shardtune.train.core.sampling import generate_ids


def run_case(case: dict, rank: int, world: int) -> dict:
    return _run(case["folder"], json.loads(Path(case["prompt"]).read_text()), rank, world)


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
    serve(run_case)
