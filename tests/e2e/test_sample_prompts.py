"""`train.sample_prompts` against transformers alone: a 2-rank zero3 run of the cut SmolLM2 fixture
(real weights, real chat template) through the real CLI answers its prompts at steps 1 and 2; each
answer equals transformers' `apply_chat_template(add_generation_prompt=True)` + greedy `generate`
on the weights torch's own DCP reader loads from that step's checkpoint. One launch."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from _runs import REPO, dcp_model

from shardtune.processes import run_bounded
from shardtune.testing.smollm2 import cut_folder

pytestmark = [pytest.mark.e2e]
PROMPTS = ["What is the capital of France?", "Write the date 2024-03-05 in words."]
NEW = 10


@pytest.mark.timeout(400)
def test_samples_at_each_evaluation_equal_transformers_generate_on_that_steps_checkpoint(tmp_path):
    from transformers import AutoTokenizer

    folder = cut_folder(2)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "response": f"{i} {i}"}) + "\n" for i in range(16)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"name: samples\nmodel: {{name: {json.dumps(str(folder))}}}\ndata: {{path: {json.dumps(str(data))}}}\n"
        "parallel: {strategy: zero3, precision: fp32}\noptim: {lr: 0.001, warmup_steps: 0}\n"
        f"train: {{micro_batch: 2, seq_len: 64, max_steps: 2, eval_every: 1, timeout_s: 120, "
        f"sample_prompts: {json.dumps(PROMPTS)}, sample_max_new_tokens: {NEW}}}\n"
        "checkpoint: {every: 1, keep: 2}\n")
    proc = run_bounded([sys.executable, "-m", "shardtune.cli", "train", str(recipe), "--nproc", "2",
                        "--output-dir", str(tmp_path / "run")], timeout_s=360, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in rows] == [(s, p) for s in (1, 2) for p in PROMPTS]

    tok = AutoTokenizer.from_pretrained(str(folder))
    answers = {}
    for step in (1, 2):
        model = dcp_model(tmp_path / "run" / "checkpoints" / f"step_{step}", folder, torch.float32)
        for r in (r for r in rows if r["step"] == step):
            ids = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            assert r["prompt_ids"] == list(ids)  # the prompt as transformers renders a generation prompt
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            want = out[0, len(ids):].tolist()
            assert r["completion_ids"] == want, (step, r["prompt"], r["completion_ids"], want)
            assert r["completion"] == tok.decode([t for t in want if t != tok.eos_token_id], skip_special_tokens=True)
            answers[step, r["prompt"]] = want
    assert any(len(a) > 1 for a in answers.values())  # real answers, not an immediate stop


@pytest.mark.timeout(300)
@pytest.mark.parametrize("split", ["tp", "cp"])
def test_samples_under_tensor_and_context_parallelism_equal_transformers_generate_on_the_checkpoint(tmp_path, split):
    """tp 2 with sequence parallelism: each forward's ids are padded on the right to a multiple of tp
    (both prompts have an odd length, and every other answer length is odd); cp 2: each rank runs
    the whole sequence with the model's own attention. The seeded tiny Llama after one step at lr
    1e-5 answers with a dozen tokens, not at once with eos."""
    prompts = ["reverse: abc", "reverse: hello world"]
    run = tmp_path / "run"
    proc = run_bounded([sys.executable, "-m", "shardtune.cli", "train", str(REPO / "recipes" / "tiny-cpu.yaml"),
                        "--nproc", "2", f"--{split}", "2", "--output-dir", str(run), "train.max_steps=1",
                        "train.eval_every=1", f"train.sample_prompts={json.dumps(prompts)}",
                        f"train.sample_max_new_tokens={NEW}", "optim.warmup_steps=0", "optim.lr=1e-5"],
                       timeout_s=240, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert json.loads((run / "memory.json").read_text())["effective"][split] == 2
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in rows] == [(1, p) for p in prompts]
    model = dcp_model(run / "checkpoints" / "step_1", run / "hf_export", torch.float32)  # the export's config
    eos = 257  # the byte tokenizer's (shardtune/train/data/tokenizer.py)
    for r in rows:
        assert len(r["prompt_ids"]) % 2 == 1
        with torch.no_grad():
            out = model.generate(torch.tensor([r["prompt_ids"]]), do_sample=False, max_new_tokens=NEW,
                                 eos_token_id=eos, pad_token_id=eos)
        assert r["completion_ids"] == out[0, len(r["prompt_ids"]):].tolist(), r
        assert len(r["completion_ids"]) == NEW and eos not in r["completion_ids"]
