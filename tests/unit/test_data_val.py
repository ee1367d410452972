"""Validation batches (train/data/val.py): every val example once over the ranks, equal batch
counts, labels shifted like training. Expected labels built by hand from byte values."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from shardtune.config import DataConfig, TrainConfig
from shardtune.errors import UserError
from shardtune.train.data.tokenizer import ByteTokenizer
from shardtune.train.data.val import build_val_batches

BOS, EOS, X = 256, 257, -100
WORDS = ["a", "bc", "def", "gh", "ijkl", "m", "nop"]


def _val(tmp_path, lines):
    p = tmp_path / "val.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(p)


def _segments(batches):
    """(input_ids, labels) of each example in the batches, split where position_ids restart at 0."""
    out = []
    for b in batches:
        for ids, lab, pos in zip(b["input_ids"].tolist(), b["labels"].tolist(), b["position_ids"].tolist()):
            starts = [t for t, p in enumerate(pos) if p == 0] + [len(pos)]
            for a, z in zip(starts, starts[1:]):
                if any(v != X for v in lab[a:z]):
                    out.append((tuple(ids[a:z]), tuple(lab[a:z])))
    return out


def _expected(word):
    ids = [BOS, *map(ord, word), EOS]
    return tuple(ids), tuple(ids[1:] + [X])


def test_none_without_val_path():
    assert build_val_batches(DataConfig(), TrainConfig(seq_len=16, micro_batch=2), ByteTokenizer(), 0, 1) is None


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_union_over_ranks_is_every_example_once(tmp_path, world, packing):
    cfg = DataConfig(val_path=_val(tmp_path, [{"text": w} for w in WORDS]), packing=packing)
    train = TrainConfig(seq_len=12, micro_batch=2)
    per_rank = [build_val_batches(cfg, train, ByteTokenizer(), r, world) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1  # same count on every rank
    for batches in per_rank:
        for b in batches:
            assert all(tuple(t.shape) == (2, 12) for t in b.values())
    got = Counter(seg for batches in per_rank for seg in _segments(batches))
    assert got == Counter(_expected(w) for w in WORDS)


def test_prompt_tokens_carry_no_loss(tmp_path):
    cfg = DataConfig(val_path=_val(tmp_path, [{"prompt": "ab\n", "response": "c"}]), template="plain")
    (b,) = build_val_batches(cfg, TrainConfig(seq_len=8, micro_batch=1), ByteTokenizer(), 0, 1)
    assert b["labels"].tolist() == [[X, X, X, 99, EOS, X, X, X]]


def test_val_without_targets_is_one_line(tmp_path):
    cfg = DataConfig(val_path=_val(tmp_path, [{"prompt": "abcdefgh", "response": "x"}]), template="plain")
    with pytest.raises(UserError, match="no target token") as e:
        build_val_batches(cfg, TrainConfig(seq_len=4, micro_batch=1), ByteTokenizer(), 0, 1)
    assert "\n" not in str(e.value)


def _texts(records):
    return [r["text"] for r in records]


def test_val_split_holds_out_a_seeded_fraction(tmp_path):
    """data.val_split: round(f × n) examples held out, never trained on, the same at every train.seed;
    its val batches equal those of a val_path file holding exactly the held-out examples."""
    from shardtune.train.data.dataset import build_dataset
    from shardtune.train.data.sources import read_records

    words = [f"w{i:03d}" for i in range(200)]
    path = _val(tmp_path, [{"text": w} for w in words])
    cfg = DataConfig(path=path, val_split=0.05, packing=False, cache_dir=None)
    train, val = _texts(read_records(cfg)), _texts(read_records(cfg, part="val"))
    assert len(val) == 10 and len(train) == 190 and sorted(train + val) == words
    assert val == sorted(val)  # file order
    assert _texts(read_records(cfg, part="val")) == val  # seeded: the same split every time
    assert val != words[:10] and val != words[-10:]  # a random choice, not a slice
    for seed in (0, 1):
        data = build_dataset(cfg, 8, ByteTokenizer(), seed=seed)
        seen = [bytes(t for t in data.tokens[a:b] if t < 256).decode() for a, b in zip(data.offsets, data.offsets[1:])]
        assert sorted(seen) == sorted(train)  # training sees every other example, and none held out, at any seed
    held = tmp_path / "held"
    held.mkdir()
    ref = DataConfig(val_path=_val(held, [{"text": w} for w in val]), packing=False)
    tc = TrainConfig(seq_len=8, micro_batch=2)
    for rank in (0, 1):
        got, want = (build_val_batches(c, tc, ByteTokenizer(), rank, 2) for c in (cfg, ref))
        assert [{k: v.tolist() for k, v in b.items()} for b in got] == \
            [{k: v.tolist() for k, v in b.items()} for b in want]


@pytest.mark.parametrize("extra, match", [({"val_path": "v.jsonl"}, "not both"),
                                          ({"val_split": 1.0}, "less than 1"),
                                          ({"val_split": 0}, "greater than 0")])
def test_val_split_refusals(extra, match):
    from shardtune.config import build_config

    with pytest.raises(UserError, match=match) as e:
        build_config({"data": {"path": "x.jsonl", "val_split": 0.05, **extra}})
    assert "\n" not in str(e.value)


def test_val_split_of_too_few_examples_is_one_line(tmp_path):
    from shardtune.train.data.sources import read_records

    cfg = DataConfig(path=_val(tmp_path, [{"text": "a"}]), val_split=0.5)
    with pytest.raises(UserError, match="leaves none to train on"):
        read_records(cfg)
