"""parallel/cp.py's batch side on one process (no collective): the documents read from the FULL
row's position ids (transformers' rule: a document starts where a position does not follow its
predecessor), each rank's piece of the rows, and the padding a length that does not divide gets."""
from __future__ import annotations

import torch
from torch import nn

from shardtune.parallel.cp import CP_ATTR, IGNORE_INDEX, CPState, cp_degree, shard_batch


def _model(rank: int, size: int, tp: int = 1) -> nn.Module:
    m = nn.Module()
    setattr(m, CP_ATTR, CPState(None, rank, size, tp, sequence_parallel=True))
    return m


def test_documents_come_from_the_full_rows():
    state = CPState(None, 0, 2, 1, True)
    state.set_positions(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [5, 6, 7, 8, 9, 10, 11, 12]]))
    # row 1 does not start at 0 (a document cut by packing): one document, as transformers reads it
    assert state.segments == [[(0, 3), (3, 5), (5, 8)], [(0, 8)]]


def test_each_rank_gets_its_rows_and_the_pieces_make_the_batch():
    ids = torch.arange(16).reshape(2, 8)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
    batch = {"input_ids": ids, "position_ids": pos, "labels": ids + 100, "other": "kept"}
    pieces = [shard_batch(_model(r, 2), batch) for r in range(2)]
    for key in ("input_ids", "position_ids", "labels"):
        assert torch.equal(torch.cat([p[key] for p in pieces], dim=1), batch[key])
    assert pieces[1]["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert pieces[0]["other"] == "kept"
    assert shard_batch(nn.Module(), batch) is batch and cp_degree(nn.Module()) == 1 and cp_degree(_model(0, 2)) == 2


def test_a_length_that_does_not_divide_is_padded_with_unlabelled_tokens_of_the_last_document():
    batch = {"input_ids": torch.tensor([[7, 8, 9]]), "position_ids": torch.tensor([[0, 0, 1]]),
             "labels": torch.tensor([[8, 9, 1]])}
    model = _model(1, 2, tp=2)  # with sequence parallelism: the length must divide by cp x tp = 4
    piece = shard_batch(model, batch)
    assert piece["input_ids"].tolist() == [[9, 0]]
    assert piece["position_ids"].tolist() == [[1, 2]]  # the pad continues the last document
    assert piece["labels"].tolist() == [[1, IGNORE_INDEX]]
    assert getattr(model, CP_ATTR).segments == [[(0, 1), (1, 4)]]
