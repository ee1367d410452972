"""Two mixed sources on 2 real ranks, resumed on 1 and on 3 ranks: the rows continue exactly the
uninterrupted one-process stream (built in this process without the cache); every rank ends with
the same state; the ranks share one tokenised cache, built once."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from shardtune.config import DataConfig, TrainConfig
from shardtune.train.data.dataset import build_dataloader
from shardtune.train.data.tokenizer import ByteTokenizer

from _harness import launch

WORKER = Path(__file__).with_name("_data_mix_worker.py")


def _src(tmp_path, name, n):
    p = tmp_path / f"{name}.jsonl"
    p.write_text("".join(json.dumps({"text": f"{name}{i:03d}"}) + "\n" for i in range(n)))
    return str(p)


def _run(tmp_path, tag, cfg, nproc, n, micro, state=""):
    out = tmp_path / tag
    out.mkdir()
    launch(WORKER, nproc, [cfg.model_dump_json(), str(out), str(n), str(micro), state], 120, out / "logs")
    per_rank = [json.loads((out / f"rows{r}.json").read_text()) for r in range(nproc)]
    states = {(out / f"state{r}.json").read_text() for r in range(nproc)}
    assert len(states) == 1, states  # every rank holds the same position of every source
    rows = [row for b in range(n) for r in range(nproc) for row in per_rank[r][b]]
    return rows, out / "state0.json"


@pytest.mark.timeout(400)
def test_two_sources_resume_on_one_and_three_ranks(tmp_path):
    sources = [{"path": _src(tmp_path, "a", 40), "weight": 2.0}, {"path": _src(tmp_path, "b", 15), "weight": 1.0}]
    cfg = DataConfig(packing=False, sources=sources, cache_dir=str(tmp_path / "cache"))
    first, state = _run(tmp_path, "two", cfg, 2, 6, 2)  # 24 rows: source b (15 rows) wraps its epoch
    ref_cfg = DataConfig(packing=False, sources=sources, cache_dir=None)  # in memory: not the code path under test
    ref_ld = build_dataloader(ref_cfg, TrainConfig(seq_len=16, micro_batch=1), ByteTokenizer(), 0, 1, 7)
    reference = [bytes(i for i in next(ref_ld)["input_ids"][0].tolist() if i < 256).decode() for _ in range(60)]
    assert first == reference[:24]
    one, _ = _run(tmp_path, "one", cfg, 1, 3, 4, str(state))
    three, _ = _run(tmp_path, "three", cfg, 3, 2, 2, str(state))
    assert one == reference[24:36]
    assert three == reference[24:36]
    built = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len([b for b in built if not b.endswith(".lock")]) == 2 and not [b for b in built if ".tmp-" in b]
