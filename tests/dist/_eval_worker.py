"""One rank of tests/dist/test_eval.py: shardtune's evaluate() on a zero3-sharded model of the cut
SmolLM2 fixture. A case (`_rank.serve`): {name, folder, batches: path of a json file holding, per
rank, a list of batches {input_ids, labels, position_ids} (labels already shifted, shardtune's
convention)}; it measures the validation loss and whether the model is back in train mode."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from _rank import serve

from shardtune.config import ModelConfig, ParallelConfig
from shardtune.parallel.mesh import build_mesh
from shardtune.train.core.evaluate import evaluate
from shardtune.train.core.model import build_model
from shardtune.train.core.step import StepOptions


def run_case(case: dict, rank: int, world: int) -> dict:
    return _run(case["folder"], Path(case["batches"]), rank, world)


def _run(folder, spec, rank, world) -> dict:
    batches = [{k: torch.tensor(v) for k, v in b.items()} for b in json.loads(spec.read_text())[rank]]
    pcfg = ParallelConfig(strategy="zero3", precision="fp32")
    mesh = build_mesh(pcfg, world, world, "cpu")
    model = build_model(ModelConfig(name=folder), pcfg, mesh, torch.device("cpu"), seed=0)
    model.train()
    loss = evaluate(model, batches, torch.device("cpu"), StepOptions())
    out = {"val_loss": loss, "training_after": model.training,
           "empty": evaluate(model, [], torch.device("cpu"), StepOptions())}  # every rank without a batch: nan, no hang
    return out


if __name__ == "__main__":
    serve(run_case)
