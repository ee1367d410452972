"""One rank of tests/dist/test_eval.py: shardtune's evaluate() on a zero3-sharded model of the cut
SmolLM2 fixture. argv: folder batches.json out_dir; batches.json holds, per rank, a list of
batches {input_ids, labels, position_ids} (labels already shifted, shardtune's convention).
Writes rank<r>.json: the validation loss and whether the model is back in train mode."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from _rank import process_group, write_result

from shardtune.config import ModelConfig, ParallelConfig
from shardtune.parallel.apply import build_mesh
from shardtune.train.core.evaluate import evaluate
from shardtune.train.core.step import StepOptions
from shardtune.train.core.model import build_model


def main() -> None:
    folder, spec, out_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    with process_group() as (rank, world):
        out = _run(folder, spec, rank, world)
    write_result(out_dir, rank, out)


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
    main()
