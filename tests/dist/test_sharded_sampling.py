"""generate_ids on a zero3-sharded model (2 gloo ranks, the cut SmolLM2 fixture: real weights)
against transformers' own `generate(do_sample=False)` on the unsharded model; a sampled answer is
the same on both ranks and equals generate_ids on the unsharded model with the same seed. The case
runs in the tier's shared 2-rank launch (tests/dist/conftest.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardtune.testing.smollm2 import cut_folder
from shardtune.train.core.sampling import generate_ids

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_sampling_worker.py"
# new tokens: one full forward each (no KV cache) on every rank; at seed 3 the sampled answer leaves
# the greedy one at its 6th token (the check below that it really sampled), so 8 are enough
NEW = 8


def _prompt(folder: Path) -> tuple[list[int], list[int]]:
    """(the chat prompt's ids, the stop ids)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids), [tok.eos_token_id]


def world2_cases(d: Path) -> tuple[list[dict], float]:
    ids, stop = _prompt(cut_folder(2))
    (d / "prompt.json").write_text(json.dumps({"ids": ids, "max_new_tokens": NEW, "stop_ids": stop}))
    return [{"name": "sampling", "folder": str(cut_folder(2)),
             "prompt": str(d / "prompt.json")}], 240


DIST_LAUNCHES = {2: world2_cases}  # one shared launch per world (tests/dist/conftest.py)


@pytest.mark.timeout(300, func_only=True)
def test_zero3_greedy_equals_transformers_generate_and_sampling_agrees_across_ranks(dist_launch, request):
    from transformers import AutoModelForCausalLM

    ranks = [r["sampling"] for r in dist_launch(request.module, 2)[1]]
    folder = cut_folder(2)
    ids, stop = _prompt(folder)

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    x = torch.tensor([ids])
    ref = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                         eos_token_id=stop, pad_token_id=stop[0])[0, len(ids):].tolist()
    sampled_ref = generate_ids(model, ids, max_new_tokens=NEW, stop_ids=stop, temperature=0.9, top_p=0.9, seed=3)
    assert len(ref) > 0
    for r in ranks:
        assert r["greedy"] == ref, (r["greedy"], ref)
        assert r["sampled"] == sampled_ref, (r["sampled"], sampled_ref)
        assert r["training_after"] is True
    assert ranks[0]["sampled"] != ref  # the sampled path really sampled (seed 3 leaves the greedy answer)
