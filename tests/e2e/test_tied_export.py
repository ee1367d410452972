"""LoRA and QLoRA exports of a tied-embedding model (the SmolLM2-135M-Instruct cut to 2 layers: real
weights, `tie_word_embeddings`, like Llama-3.2-1B/3B and small Qwen), as a user runs them:
`shardtune train --nproc 2` (zero3, fp32, 3 steps, a sample prompt answered at the last step, the
end-of-run export; QLoRA with torchao's 8-bit AdamW, its run shared with tests/e2e/test_effective.py),
then `shardtune export` and `shardtune generate`.

Independent references:
- torch's own DCP reader: the checkpoint holds adapters only (no frozen base, no tied lm_head);
- plain `AutoModelForCausalLM.from_pretrained` of the export: no missing or unexpected tensors, the
  config's dtype is the dtype safetensors stores (safe_open), and the model loads in it;
- PEFT's own merge (`PeftModel.from_pretrained(source, adapter folder).merge_and_unload()`) on the
  source folder (QLoRA: its MLP projections through torchao's `to_nf4`, the hand-derived
  docs/qlora.md rule for 576 × 1536 on 2 shards) gives the export's logits;
- the run's own samples.jsonl (the training model's greedy answer at the last step) is what
  `shardtune generate` answers from the export and from the checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardtune.processes import run_bounded
from shardtune.testing.smollm2 import cut_folder

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]
PROMPT = "Reverse the string: hello"
RECIPE = """
name: tied-{kind}
model: {{name: {src}, init: pretrained}}
data: {{generated_examples: 64, tokenizer: auto}}
parallel: {{strategy: zero3, precision: fp32}}
optim: {{name: {optim}, lr: 0.01, warmup_steps: 0, schedule: constant}}
train: {{micro_batch: 2, seq_len: 64, max_steps: 3, timeout_s: 120, eval_every: 3,
         sample_prompts: ["{prompt}"], sample_max_new_tokens: 12}}
checkpoint: {{every: 3, export_hf: true}}
lora: {{rank: 4, alpha: 8, quantize_base: {quant}}}
"""


def _shardtune(*args: str, timeout_s: float = 400) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    return run_bounded([sys.executable, "-m", "shardtune.cli", *args], timeout_s=timeout_s, cwd=REPO,
                       stderr=subprocess.STDOUT, env=env)


def recipe(kind: str) -> str:
    """The run's recipe; QLoRA's with torchao's 8-bit AdamW, so tests/e2e/test_effective.py's QLoRA
    checks (resume after the first checkpoint, compile vs eager) read the same shared run."""
    quant, optim = ("nf4", "adamw-8bit") if kind == "qlora" else ("none", "adamw")
    return RECIPE.format(kind=kind, src=cut_folder(2), prompt=PROMPT, quant=quant, optim=optim)


@pytest.fixture(scope="module", params=["lora", "qlora"])
def run(request, shared_run) -> tuple[str, Path]:
    """`shardtune train recipe(kind) --nproc 2`, shared (read-only: copy to change)."""
    folder, proc = shared_run(recipe(request.param), nproc=2, timeout_s=400)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return request.param, folder


def _reference(kind: str, adapter: Path):
    """PEFT's merge of the adapters onto the source folder's weights in fp32 (QLoRA: the base the
    forward saw, each MLP projection NF4-quantised and dequantised by torchao)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(cut_folder(2), dtype=torch.float32)
    if kind == "qlora":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        with torch.no_grad():
            for name, p in base.named_parameters():
                if name.split(".")[-2] in ("gate_proj", "up_proj", "down_proj"):  # 576·1536 = 27 · 64·256·2
                    p.copy_(to_nf4(p.detach().clone(), 64, 256).get_original_weight())
    return PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().eval()


def _stored_dtypes(folder: Path) -> set[str]:
    from safetensors import safe_open

    out = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            out |= {str(st.get_slice(k).get_dtype()) for k in st.keys()}
    return out


@pytest.mark.timeout(900)
def test_merged_export_of_a_tied_model_is_complete_and_answers_as_training_did(run, tmp_path, capsys):
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from shardtune import cli

    kind, run_dir = run
    ckpt = run_dir / "checkpoints" / "step_3"
    saved = [k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), [k for k in saved if "lora" not in k]

    export = run_dir / "hf_export"
    model, info = AutoModelForCausalLM.from_pretrained(str(export), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    config = json.loads((export / "config.json").read_text())
    assert _stored_dtypes(export) == {"F32"} and config["dtype"] == "float32", config.get("dtype")
    assert next(model.parameters()).dtype == torch.float32  # loads as stored, nothing silently cast
    assert "shardtune_lora" not in config and config["tie_word_embeddings"] is True

    assert cli.main(["export", str(ckpt), str(tmp_path / "adapter"), "--adapter-only"]) == 0
    ref = _reference(kind, tmp_path / "adapter")
    ids = torch.tensor([[1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 198, 1, 4093, 198]])
    with torch.no_grad():
        got, want = model.eval()(ids).logits, ref(ids).logits
        base = AutoModelForCausalLM.from_pretrained(cut_folder(2), dtype=torch.float32).eval()(ids).logits
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert (got - base).abs().max() > 1e-2  # the adapters trained: the merge is not the source

    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    sample = next(r for r in rows if r["step"] == 3)
    assert sample["completion"].strip(), sample  # an answer, not the empty line of a bad load
    capsys.readouterr()
    for target in (run_dir, ckpt):  # the export; the checkpoint merged on the fly
        rc = cli.main(["generate", str(target), "--prompt", PROMPT, "--max-new-tokens", "12"])
        out = capsys.readouterr()
        assert rc == 0, out.err
        assert out.out.strip() == sample["completion"].strip(), (target, out.out, sample)

    if kind == "lora":  # `shardtune export` as a subprocess, as a user types it, on the same checkpoint
        proc = _shardtune("export", str(ckpt), str(tmp_path / "merged"), timeout_s=240)
        assert proc.returncode == 0, proc.stdout[-2000:]
        again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
        with torch.no_grad():
            torch.testing.assert_close(again(ids).logits, got, atol=0, rtol=0)


@pytest.mark.timeout(300)
def test_generate_refuses_an_export_that_holds_only_the_head(run, tmp_path, capsys):
    """The export this issue found (model.safetensors with lm_head.weight alone): one line, exit 2."""
    from safetensors.torch import load_file, save_file

    from shardtune import cli

    _, run_dir = run
    broken = tmp_path / "broken"
    shutil.copytree(run_dir / "hf_export", broken)
    weights = load_file(str(broken / "model.safetensors"))
    save_file({"lm_head.weight": weights["model.embed_tokens.weight"]}, str(broken / "model.safetensors"),
              metadata={"format": "pt"})
    (broken / ".shardtune_export.json").unlink(missing_ok=True)  # a folder as another tool left it
    capsys.readouterr()
    assert cli.main(["generate", str(broken), "--prompt", PROMPT]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1, out
    assert "lacks model." in out.err and "Traceback" not in out.err


@pytest.mark.timeout(900)
def test_a_tied_model_under_tp_trains_and_exports_what_one_process_does(tmp_path):
    """SmolLM2 (tied embeddings; 9 heads, 3 KV heads: tp 3) fully fine-tuned at tp 3 against one
    process, 3 steps: the embedding and the head share one vocabulary-split weight, whose gradient
    is the sum of both uses. The losses, and the exports' logits."""
    from transformers import AutoModelForCausalLM

    text = RECIPE.format(kind="tp", src=cut_folder(2), prompt=PROMPT, quant="none", optim="adamw")
    text = text.replace("lr: 0.01", "lr: 0.001").replace("seq_len: 64", "seq_len: 66").replace("rank: 4", "rank: 0")
    (tmp_path / "recipe.yaml").write_text(text)
    losses, exports = {}, {}
    for name, args in (("one", ["--nproc", "1"]), ("tp", ["--nproc", "3", "--tp", "3", "train.micro_batch=2"])):
        out = tmp_path / name
        proc = _shardtune("train", str(tmp_path / "recipe.yaml"), *args, "--output-dir", str(out),
                          "train.eval_every=0", "train.sample_prompts=[]", "checkpoint.every=0")
        assert proc.returncode == 0, proc.stdout[-3000:]
        eff = json.loads((out / "memory.json").read_text())["effective"]
        assert (eff["tp"], eff["lora_rank"], eff["loss_chunks"]) == ((3, 0, 1) if name == "tp" else (1, 0, 8)), eff
        losses[name] = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        exports[name] = AutoModelForCausalLM.from_pretrained(str(out / "hf_export")).eval()
        if name == "tp":  # torch's tracker against the planner (plan/tp.py `tied_tp_embedding_grad_bytes`)
            measured = max(r["tracked"]["total"] for r in json.loads((out / "memory.json").read_text())["per_rank"])
            planned = json.loads((out / "plan.json").read_text())["strategies"][0]["memory"]["total"]
            assert 0.97 <= measured / planned <= 1.03, (measured, planned)
    # steps 1-2 within fp32 rounding; step 3 comes after two AdamW updates, whose normalisation of
    # near-zero gradients amplifies tp's different summation order (2.0e-6 apart measured on one
    # machine, under 1e-6 on another: the CPU's matmul kernels set the rounding)
    assert len(losses["tp"]) == 3 and losses["tp"][:2] == pytest.approx(losses["one"][:2], rel=1e-6), losses
    assert losses["tp"][2] == pytest.approx(losses["one"][2], rel=1e-5), losses
    assert exports["tp"].config.tie_word_embeddings is True
    ids = torch.tensor([[1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 198, 1, 4093, 198]])
    with torch.no_grad():
        torch.testing.assert_close(exports["tp"](ids).logits, exports["one"](ids).logits, atol=2e-4, rtol=1e-4)
