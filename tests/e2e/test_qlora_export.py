"""QLoRA as a user runs it: `shardtune train RECIPE --nproc 1` with lora.quantize_base nf4 (ddp on one
process: FSDP2 needs 2 ranks for NF4,
fp32, a checkpoint at step 4), then `shardtune export` (merged) and `--adapter-only`.

Independent references: the loss the trainer logged at step 5 is the step-4 weights' loss on the
step-5 batch; the merged step-4 export (the NF4 base dequantised + alpha/r · B A), loaded with
`AutoModelForCausalLM.from_pretrained`, gives it again (torch's cross_entropy here). PEFT's own
`PeftModel.from_pretrained` on the base as torchao dequantises it gives the merged logits.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_export import _step5_batch  # noqa: E402  (the step-5 batch from step_4's data position)

from shardtune import cli
from shardtune.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 264, "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
          "hidden_act": "silu", "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258,
          "initializer_range": 0.02}
RECIPE = """
name: qlora-export
model: {{name: {cfg}, init: random}}
data: {{generated_examples: 200, tokenizer: byte}}
parallel: {{strategy: ddp, precision: fp32}}
optim: {{lr: 0.01, warmup_steps: 0, schedule: constant}}
train: {{micro_batch: 4, seq_len: 64, max_steps: 5, timeout_s: 60}}
checkpoint: {{every: 4, export_hf: false}}
lora: {{rank: 4, alpha: 8, quantize_base: nf4}}
"""


def _shardtune(*args: str, timeout_s: float = 400) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    return run_bounded([sys.executable, "-m", "shardtune.cli", *args], timeout_s=timeout_s, cwd=REPO,
                       stderr=subprocess.STDOUT, env=env)


@pytest.mark.timeout(900)  # train (a process) + two exports (in this one): > 420 s wall at load 17 before
def test_qlora_merged_export_gives_the_logged_loss_and_the_adapter_loads_in_peft(tmp_path):
    from peft import PeftModel
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    from transformers import AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "recipe.yaml").write_text(RECIPE.format(cfg=tmp_path / "config.json"))
    run = tmp_path / "run"
    proc = _shardtune("train", str(tmp_path / "recipe.yaml"), "--nproc", "1", "--output-dir", str(run))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert json.loads((run / "plan.json").read_text())["inputs"]["quantize_base"] == "nf4"
    merged_dir = tmp_path / "merged"
    assert cli.main(["export", str(run / "checkpoints" / "step_4"), str(merged_dir)]) == 0  # in this process
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    b = _step5_batch(run)
    with torch.no_grad():
        # use_cache False: packed rows (position ids restarting inside a row) get transformers'
        # block-diagonal mask only without a KV cache, as in training; the export keeps use_cache on
        logits = merged(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
    logged = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert float(loss) == pytest.approx(logged[5], abs=1e-5)
    assert json.loads((merged_dir / "config.json").read_text()).get("use_cache", True) is True

    adapter_dir = tmp_path / "adapter"
    assert cli.main(["export", str(run / "checkpoints" / "step_4"), str(adapter_dir), "--adapter-only"]) == 0
    from shardtune.config import ModelConfig
    from shardtune.train.core.model import build_hf_config, init_model_weights

    mcfg = ModelConfig(name=str(tmp_path / "config.json"), init="random")
    base = AutoModelForCausalLM.from_config(build_hf_config(mcfg), attn_implementation="sdpa")
    init_model_weights(base, mcfg, seed=0)
    with torch.no_grad():  # the base the run trained on: every projection through torchao's NF4
        for name, p in base.named_parameters():
            if name.endswith("_proj.weight"):
                p.copy_(to_nf4(p.detach().clone()).get_original_weight())
    peft = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        got = peft(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
    assert torch.allclose(got, logits, atol=1e-5)
