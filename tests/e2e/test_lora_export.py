"""LoRA as a user runs it: `shardtune train RECIPE --nproc 1 --lora-rank 4` (torchrun, zero3, fp32,
a checkpoint at step 4, merged export at the end), then `shardtune export --adapter-only`.

Independent references:
- the loss the trainer logged at step 5 is the step-4 weights' loss on the step-5 batch; the
  merged step-4 export, loaded with `AutoModelForCausalLM.from_pretrained`, gives the same loss on
  that batch (recomputed here with torch's cross_entropy);
- PEFT's own `PeftModel.from_pretrained(base, adapter folder)` gives the merged model's logits.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_export import _step5_batch  # noqa: E402  (the step-5 batch from step_4's data position)

from shardtune import cli

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]
RECIPE = """
name: lora-export
model: {name: tiny-llama}
data: {generated_examples: 200}
parallel: {strategy: zero3, precision: fp32}
optim: {lr: 0.01, warmup_steps: 0, schedule: constant}
train: {micro_batch: 4, seq_len: 64, max_steps: 5, timeout_s: 60}
checkpoint: {every: 4, export_hf: true}
lora: {alpha: 8}
"""


@pytest.fixture
def run(shared_run) -> Path:
    """`shardtune train RECIPE --nproc 1 --lora-rank 4`, trained once for this file and the LoRA test
    of tests/e2e/test_generate.py: read-only, copy to change."""
    folder, proc = shared_run(RECIPE, "--lora-rank", "4", nproc=1)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return folder


@pytest.mark.timeout(600)  # the fixture's training and two exports: 31 CPU-s, 163 s wall at load 10
def test_merged_export_gives_the_logged_loss_and_the_adapter_folder_loads_in_peft(run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardtune.config import ModelConfig, load_recipe
    from shardtune.train.core.model import build_hf_config, init_model_weights

    assert load_recipe(run / "config.yaml").lora.rank == 4  # the --lora-rank flag reached the run
    assert json.loads((run / "plan.json").read_text())["inputs"]["lora_rank"] == 4
    merged_dir = tmp_path / "merged"
    assert cli.main(["export", str(run / "checkpoints" / "step_4"), str(merged_dir)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    b = _step5_batch(run)
    with torch.no_grad():
        logits = merged(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
    logged = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert float(loss) == pytest.approx(logged[5], abs=1e-5)
    assert (run / "hf_export" / "config.json").is_file()  # the end-of-run export (step 5) exists

    adapter_dir = tmp_path / "adapter"
    assert cli.main(["export", str(run / "checkpoints" / "step_4"), str(adapter_dir), "--adapter-only"]) == 0
    base = AutoModelForCausalLM.from_config(build_hf_config(ModelConfig()))
    init_model_weights(base, ModelConfig(), seed=0)  # the run's frozen base (train.seed 0)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    ids = b["input_ids"][:2]
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, merged(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(120)
def test_adapter_only_on_a_full_fine_tune_is_one_line_exit_2(run, tmp_path, capsys):
    """A checkpoint without LoRA: --adapter-only is refused in one line (a fake non-LoRA config)."""
    import shutil

    ckpt = tmp_path / "step_4"
    shutil.copytree(run / "checkpoints" / "step_4", ckpt)
    cfg = json.loads((ckpt / "hf" / "config.json").read_text())
    cfg.pop("shardtune_lora")
    (ckpt / "hf" / "config.json").write_text(json.dumps(cfg))
    from shardtune.train.durable import integrity  # re-record the edited file, so the checksum check passes

    meta = json.loads((ckpt / "shardtune_checkpoint.json").read_text())
    edited = ckpt / "hf" / "config.json"
    meta["files"]["hf/config.json"] = [edited.stat().st_size, integrity.crc32_file(edited)]
    (ckpt / "shardtune_checkpoint.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert cli.main(["export", str(ckpt), str(tmp_path / "out"), "--adapter-only"]) == 2
    out = capsys.readouterr()
    assert len(out.err.strip().splitlines()) == 1, out.err
    assert "not trained with LoRA" in out.err and "Traceback" not in out.err + out.out
