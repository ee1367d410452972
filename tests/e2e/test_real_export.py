"""The whole SmolLM2-135M-Instruct fixture through `shardtune train` (one step at lr 1e-9, so the
weights stay the pretrained ones to ~1e-9) and its end-of-run export, checked with transformers
alone: the exported folder loads with from_pretrained, gives the source folder's logits, carries
the source's generation_config and tokenizer files (0644, like the rest), and greedy generation
stops at <|im_end|> with the right answer."""
from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardtune.processes import run_bounded
from shardtune.testing.smollm2 import full_folder

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    src = full_folder()
    run = tmp_path_factory.mktemp("real") / "run"
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(ROOT / "recipes" / "tiny-cpu.yaml"), "--nproc", "1",
           "--output-dir", str(run), f"model.name={src}", "model.init=auto", "data.tokenizer=auto",
           "optim.lr=1e-9", "optim.warmup_steps=0", "train.max_steps=1", "train.micro_batch=1",
           "train.seq_len=64", "data.generated_examples=64"]
    out = run_bounded(cmd, 600, cwd=ROOT, stderr=subprocess.STDOUT)  # a hung run dies with its process group
    assert out.returncode == 0, out.stdout[-3000:]
    return src, run / "hf_export"


def test_export_carries_generation_config_and_tokenizer_files_with_the_same_modes(exported):
    src, hf = exported
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (hf / name).is_file(), name
        assert (hf / name).read_bytes() == (src / name).read_bytes(), name
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in hf.iterdir() if p.is_file()}
    assert len(set(modes.values())) == 1, modes
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] in (2, [2])


def test_exported_model_gives_the_source_logits_and_stops_at_im_end(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, hf = exported
    tok = AutoTokenizer.from_pretrained(str(hf))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ref = AutoModelForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32).eval()
    got = AutoModelForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, ref(ids).logits, atol=1e-3, rtol=1e-3)
        gen = got.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1]:].tolist()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in gen and len(gen) < 40, gen  # stopped at the stop token, before the limit
    assert gen[-1] == im_end
    assert "Paris" in tok.decode(gen[:-1])


def test_full_fine_tune_export_says_the_dtype_it_stores(exported):
    """The fp32 weights of a full fine-tune of a bf16 source: config.json says float32 (not the
    source's bfloat16), so a plain from_pretrained loads them as stored."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    src, hf = exported
    assert json.loads((src / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(hf / "model.safetensors"), "pt") as st:
        stored = {str(st.get_slice(k).get_dtype()) for k in st.keys()}
    config = json.loads((hf / "config.json").read_text())
    assert stored == {"F32"} and config["dtype"] == config["torch_dtype"] == "float32", (stored, config)
    assert next(AutoModelForCausalLM.from_pretrained(str(hf)).parameters()).dtype == torch.float32
