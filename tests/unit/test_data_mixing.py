"""Mixing data.sources (train/data/mix.py): resume at another world size continues every source
exactly (against an uninterrupted one-rank stream), each source's rows in its own order, shares
following the weights, and bad weights one line."""
from __future__ import annotations

import json

import pytest

from shardtune.config import DataConfig, TrainConfig
from shardtune.train.data.dataset import build_dataloader
from shardtune.train.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _src(tmp_path, name, n):
    p = tmp_path / f"{name}.jsonl"
    p.write_text("".join(json.dumps({"text": f"{name}{i:03d}"}) + "\n" for i in range(n)))
    return str(p)


def _cfg(tmp_path, weights=(3.0, 1.0)):
    return DataConfig(packing=False, sources=[{"path": _src(tmp_path, "a", 40), "weight": weights[0]},
                                              {"path": _src(tmp_path, "b", 25), "weight": weights[1]}])


def _text(row) -> str:
    return bytes(i for i in row if i < 256).decode()


def _rows(cfg, world, micro, n_batches, state=None):
    """The global row stream of `world` ranks for n_batches micro-batches (rank order within each)."""
    loaders = [build_dataloader(cfg, TrainConfig(seq_len=16, micro_batch=micro), TOK, r, world, 7)
               for r in range(world)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(json.loads(json.dumps(state)))
    out = []
    for _ in range(n_batches):
        for ld in loaders:
            out += [_text(r) for r in next(ld)["input_ids"].tolist()]
    assert len({json.dumps(ld.state_dict()) for ld in loaders}) == 1  # every rank holds the same position
    return out, loaders[0].state_dict()


@pytest.mark.parametrize("world_after,micro_after", [(1, 4), (3, 2)])
def test_resume_at_another_world_size_continues_every_source(tmp_path, world_after, micro_after):
    cfg = _cfg(tmp_path)
    first, state = _rows(cfg, 2, 2, 10)  # 40 rows on 2 ranks: one epoch of b passed, a not yet
    after, _ = _rows(cfg, world_after, micro_after, 6, state)
    reference, _ = _rows(cfg, 1, 1, len(first) + len(after))
    assert first + after == reference


def test_each_source_in_its_own_order_and_shares_follow_weights(tmp_path):
    cfg = _cfg(tmp_path)
    rows, _ = _rows(cfg, 1, 8, 100)  # 800 rows
    a = [r for r in rows if r.startswith("a")]
    b = [r for r in rows if r.startswith("b")]
    assert len(a) + len(b) == 800
    assert abs(len(a) / 800 - 0.75) < 0.05  # binomial sd 0.015
    for rs, n in ((a, 40), (b, 25)):  # every epoch is a permutation of the source
        for e in range(len(rs) // n):
            assert sorted(rs[e * n:(e + 1) * n]) == sorted(f"{rs[0][0]}{i:03d}" for i in range(n))
    only_a, _ = _rows(_cfg(tmp_path, (1.0, 0.0)), 1, 8, 5)
    assert all(r.startswith("a") for r in only_a)


@pytest.mark.parametrize("weights,match", [((-1.0, 1.0), "is negative"), ((0.0, 0.0), "weights sum to 0")])
def test_bad_weights(tmp_path, weights, match):
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, weights)
