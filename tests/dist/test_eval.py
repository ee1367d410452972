"""Validation loss under zero3 on 2 ranks = transformers' own loss on all the examples at once.

The examples are chats of the cut SmolLM2 fixture (real weights), ids from transformers'
apply_chat_template, loss on the assistant tokens; the ranks hold unequal numbers of batches
(rank 0 two, rank 1 one), so evaluate() must run the extra forward without counting it. The case
runs in the tier's shared 2-rank launch (tests/dist/conftest.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_real_model import reference_example

from shardtune.testing.smollm2 import cut_folder

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_eval_worker.py"
SEQ = 48
CHATS = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in [
    ("What is 2+3?", "2+3 = 5."), ("Name a primary colour.", "Red."),
    ("Capital of France?", "Paris is the capital of France."), ("Say hi.", "Hi!"),
    ("Is ice cold?", "Yes, ice is cold.")]]


def _rows(tok):
    """(ids, labels) padded to SEQ, unshifted (transformers shifts them itself)."""
    ids = torch.full((len(CHATS), SEQ), tok.pad_token_id)
    labels = torch.full((len(CHATS), SEQ), -100)
    for i, msgs in enumerate(CHATS):
        x, mask = reference_example(tok, msgs)
        ids[i, :len(x)] = torch.tensor(x)
        labels[i, :len(x)] = torch.tensor([t if m else -100 for t, m in zip(x, mask)])
    return ids, labels


def _batch(ids, labels) -> dict:
    """shardtune's batch: labels[t] is the target of input t (shifted here, by hand)."""
    shifted = torch.cat([labels[:, 1:], torch.full((len(labels), 1), -100)], dim=1)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    return {"input_ids": ids.tolist(), "labels": shifted.tolist(), "position_ids": pos.tolist()}


def world2_cases(d: Path) -> tuple[list[dict], float]:
    from transformers import AutoTokenizer

    folder = cut_folder(2)
    ids, labels = _rows(AutoTokenizer.from_pretrained(str(folder)))
    per_rank = [[_batch(ids[0:2], labels[0:2]), _batch(ids[2:3], labels[2:3])],  # rank 0: two batches
                [_batch(ids[3:5], labels[3:5])]]  # rank 1: one (a different row count)
    (d / "batches.json").write_text(json.dumps(per_rank))
    return [{"name": "eval", "folder": str(folder), "batches": str(d / "batches.json")}], 240


DIST_LAUNCHES = {2: world2_cases}  # one shared launch per world (tests/dist/conftest.py)


@pytest.mark.timeout(300, func_only=True)
def test_zero3_val_loss_is_the_global_token_mean_of_transformers_loss(dist_launch, request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ranks = [r["eval"] for r in dist_launch(request.module, 2)[1]]
    folder = cut_folder(2)
    ids, labels = _rows(AutoTokenizer.from_pretrained(str(folder)))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():  # one process, all five examples in one call: HF's mean over every target token
        want = model(input_ids=ids, labels=labels).loss.item()
        mean_of_means = sum(model(input_ids=ids[s], labels=labels[s]).loss.item()
                            for s in (slice(0, 3), slice(3, 5))) / 2
    assert abs(want - mean_of_means) > 1e-3  # the test can tell a token mean from a mean of rank means
    for r in ranks:
        assert abs(r["val_loss"] - want) <= 1e-5, (r["val_loss"], want)
        assert r["training_after"] is True
        assert math.isnan(r["empty"])
