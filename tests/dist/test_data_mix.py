"""Two mixed sources on 2 real ranks, resumed on 1 and on 3 ranks: the rows continue exactly the
uninterrupted one-process stream (built in this process without the cache); every rank ends with
the same state; the ranks share one tokenised cache, built once."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from _harness import launch

from shardtune.config import DataConfig, TrainConfig
from shardtune.train.data.dataset import build_dataloader
from shardtune.train.data.tokenizer import ByteTokenizer

WORKER = Path(__file__).with_name("_data_mix_worker.py")


def _src(tmp_path, name, n, write):
    p = tmp_path / f"{name}.jsonl"
    if write:
        p.write_text("".join(json.dumps({"text": f"{name}{i:03d}"}) + "\n" for i in range(n)))
    return str(p)


def _config(d: Path, write: bool = False) -> tuple[list[dict], DataConfig]:
    """The two sources (written once, by the shared launch's case builder) and their config."""
    sources = [{"path": _src(d, "a", 40, write), "weight": 2.0}, {"path": _src(d, "b", 15, write), "weight": 1.0}]
    return sources, DataConfig(packing=False, sources=sources, cache_dir=str(d / "cache"))


def world2_cases(d: Path) -> tuple[list[dict], float]:
    """The first 6 micro-batches of 2 rows on 2 ranks (24 rows: source b, 15 rows, wraps its epoch)."""
    (d / "two").mkdir()
    cfg = _config(d, write=True)[1]
    case = {"name": "two", "cfg": cfg.model_dump_json(), "out": str(d / "two"), "n": 6,
            "micro": 2, "state": ""}
    return [case], 120


DIST_LAUNCHES = {2: world2_cases}  # one shared launch per world (tests/dist/conftest.py)


def _run(tmp_path, tag, cfg, nproc, n, micro, state=""):
    out = tmp_path / tag
    if tag != "two":  # the 2-rank run is the shared launch's
        out.mkdir()
        launch(WORKER, nproc, [cfg.model_dump_json(), str(out), str(n), str(micro), state], 120, out / "logs")
    per_rank = [json.loads((out / f"rows{r}.json").read_text()) for r in range(nproc)]
    states = {(out / f"state{r}.json").read_text() for r in range(nproc)}
    assert len(states) == 1, states  # every rank holds the same position of every source
    rows = [row for b in range(n) for r in range(nproc) for row in per_rank[r][b]]
    return rows, out / "state0.json"


@pytest.mark.timeout(400, func_only=True)
def test_two_sources_resume_on_one_and_three_ranks(dist_launch, request):
    tmp_path = dist_launch(request.module, 2)[0]
    sources, cfg = _config(tmp_path)
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
