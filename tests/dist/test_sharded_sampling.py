"""generate_ids on a zero3-sharded model (2 gloo ranks, the cut SmolLM2 fixture: real weights)
against transformers' own `generate(do_sample=False)` on the unsharded model; a sampled answer is
the same on both ranks and equals generate_ids on the unsharded model with the same seed. One
2-rank launch."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from _harness import launch, rank_results

from shardtune.testing.smollm2 import cut_folder
from shardtune.train.core.sampling import generate_ids

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_sampling_worker.py"
NEW = 12


@pytest.mark.timeout(300)
def test_zero3_greedy_equals_transformers_generate_and_sampling_agrees_across_ranks(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = cut_folder(2)
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    stop = [tok.eos_token_id]
    (tmp_path / "prompt.json").write_text(json.dumps({"ids": list(ids), "max_new_tokens": NEW, "stop_ids": stop}))
    launch(WORKER, 2, [str(folder), str(tmp_path / "prompt.json"), str(tmp_path)], timeout_s=240,
           log_dir=tmp_path / "logs")
    ranks = rank_results(tmp_path, 2)

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
