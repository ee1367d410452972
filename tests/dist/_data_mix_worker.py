"""One rank of tests/dist/test_data_mix.py: build the data.sources loader (the tokenised cache
shared by every rank, built by one under its file lock), load a state if given, take N
micro-batches, write this rank's rows as text (and its state) to OUT. argv: cfg.json OUT N MICRO
STATE, or as a case of a shared launch (`run_case`, `_rank.serve`): {name, cfg, out, n, micro, state}."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from shardtune.config import DataConfig, TrainConfig
from shardtune.train.data.dataset import build_dataloader
from shardtune.train.data.tokenizer import ByteTokenizer


def main() -> None:
    cfg_json, out, n, micro, state = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    take(cfg_json, out, n, micro, state, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


def run_case(case: dict, rank: int, world: int) -> dict:
    take(case["cfg"], Path(case["out"]), case["n"], case["micro"], case["state"], rank, world)
    return {}


def take(cfg_json: str, out: Path, n: int, micro: int, state: str, rank: int, world: int) -> None:
    cfg = DataConfig.model_validate_json(cfg_json)
    ld = build_dataloader(cfg, TrainConfig(seq_len=16, micro_batch=micro), ByteTokenizer(), rank, world, 7)
    if state:
        ld.load_state_dict(json.loads(Path(state).read_text()))
    batches = [[bytes(i for i in row if i < 256).decode() for row in next(ld)["input_ids"].tolist()]
               for _ in range(n)]
    (out / f"rows{rank}.json").write_text(json.dumps(batches))
    (out / f"state{rank}.json").write_text(json.dumps(ld.state_dict()))


if __name__ == "__main__":
    main()
