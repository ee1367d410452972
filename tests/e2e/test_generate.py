"""`shardtune generate TARGET --prompt TEXT` against transformers alone.

- The SmolLM2-135M-Instruct fixture (real weights and chat template), through the real CLI: the
  greedy answer equals transformers' own `apply_chat_template` + `generate(do_sample=False)` on the
  same folder, and "What is the capital of France?" says Paris.
- One tiny-llama run (one process, zero3, checkpoints at steps 4 and 5, export at the end): a
  checkpoint's answer equals transformers' generate on the model torch's own DCP reader loads from
  it; a run folder answers with its export, or with its newest checkpoint that verifies (a damaged
  one is skipped and named); a tampered .metadata is refused before it runs; every bad TARGET is
  one line and exit 2.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
from _runs import REPO, dcp_model
from test_export import RECIPE
from test_lora_export import RECIPE as LORA_RECIPE

from shardtune.processes import run_bounded
from shardtune.testing.smollm2 import cut_folder, full_folder

pytestmark = [pytest.mark.e2e]
QUESTION = "What is the capital of France?"


def _hf_answer(model, tok, prompt: str, max_new_tokens: int) -> str:
    """transformers alone: the chat template with a generation prompt, greedy generate, decode."""
    enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens)
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


@pytest.mark.timeout(300)
def test_real_model_folder_answers_paris_as_transformers_does():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = full_folder()
    cmd = [sys.executable, "-m", "shardtune.cli", "generate", str(folder), "--prompt", QUESTION,
           "--max-new-tokens", "30"]
    proc = run_bounded(cmd, timeout_s=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = _hf_answer(model, AutoTokenizer.from_pretrained(folder), QUESTION, 30)
    assert proc.stdout.strip() == want, (proc.stdout, want)
    assert "Paris" in proc.stdout


@pytest.fixture
def run(shared_one_process_run) -> Path:
    """tests/e2e/test_export.py's run (its RECIPE: tiny-llama, zero3, fp32, checkpoints at steps 4 and 5,
    the export at the end), trained once for both files: read-only, copy to change."""
    return shared_one_process_run(RECIPE)


def _dcp_model(ckpt: Path):
    return dcp_model(ckpt, ckpt / "hf")


def _generate(capsys, target, prompt="hello", n=24) -> tuple[int, str, str]:
    from shardtune import cli

    rc = cli.main(["generate", str(target), "--prompt", prompt, "--max-new-tokens", str(n)])
    out = capsys.readouterr()
    return rc, out.out.strip(), out.err


@pytest.mark.timeout(200)
def test_checkpoint_and_run_folder_answers_equal_transformers(run, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run / "checkpoints" / "step_4" / "hf")
    for step in (4, 5):
        ckpt = run / "checkpoints" / f"step_{step}"
        rc, out, err = _generate(capsys, ckpt)
        assert rc == 0, err
        assert out == _hf_answer(_dcp_model(ckpt), tok, "hello", 24), (step, out)
    export = AutoModelForCausalLM.from_pretrained(run / "hf_export").eval()
    rc, out, err = _generate(capsys, run)
    assert rc == 0 and f"in {run / 'hf_export'}" in err, err
    assert out == _hf_answer(export, tok, "hello", 24)


@pytest.mark.timeout(120)
def test_a_checkpoint_loads_the_weights_torchs_own_reader_reads(run):
    """The tiny model answers little (its short answers end at once), so the weights themselves are
    compared: every tensor of the model generate builds from a checkpoint = torch's DCP reader's."""
    from shardtune.train.generation import load_for_generation

    got = {}
    for step in (4, 5):
        ckpt = run / "checkpoints" / f"step_{step}"
        model, tok, stops = load_for_generation("checkpoint", ckpt)
        want = _dcp_model(ckpt).state_dict()
        got[step] = model.state_dict()
        assert got[step].keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[step][k], v), (step, k)
        assert stops == [tok.eos_token_id]
    assert not torch.equal(got[4]["model.layers.0.mlp.up_proj.weight"], got[5]["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.timeout(200)
def test_run_folder_without_a_fresh_export_uses_the_newest_checkpoint_that_verifies(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    old = (copy / "checkpoints" / "step_5" / "shardtune_checkpoint.json").stat().st_mtime - 3600
    for f in (copy / "hf_export").glob("*.safetensors"):  # an export older than the last save
        os.utime(f, (old, old))
    rc, _, err = _generate(capsys, copy)
    assert rc == 0 and f"checkpoint in {copy / 'checkpoints' / 'step_5'}" in err, err
    shard = sorted((copy / "checkpoints" / "step_5").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    rc, out, err = _generate(capsys, copy)
    assert rc == 0 and "skipping step_5" in err and f"checkpoint in {copy / 'checkpoints' / 'step_4'}" in err, err
    tok_dir = copy / "checkpoints" / "step_4" / "hf"
    from transformers import AutoTokenizer

    assert out == _hf_answer(_dcp_model(run / "checkpoints" / "step_4"), AutoTokenizer.from_pretrained(tok_dir),
                             "hello", 24)
    capsys.readouterr()  # torch's own reader above may warn "assuming ... a single process": not generate's
    rc, _, err = _generate(capsys, copy / "checkpoints" / "step_5")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "damaged" in err, err


@pytest.mark.timeout(120)
def test_a_tampered_checkpoint_is_refused_before_it_runs(run, tmp_path, capsys):
    from shardtune.train.durable import integrity

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    ckpt = tmp_path / "step_4"
    shutil.copytree(run / "checkpoints" / "step_4", ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    meta = json.loads((ckpt / "shardtune_checkpoint.json").read_text())
    meta["files"][".metadata"] = [(ckpt / ".metadata").stat().st_size, integrity.crc32_file(ckpt / ".metadata")]
    (ckpt / "shardtune_checkpoint.json").write_text(json.dumps(meta))
    rc, out, err = _generate(capsys, ckpt)
    assert rc == 2 and "refusing to load it" in err and out == "", err
    assert len([line for line in err.splitlines() if line.startswith("shardtune: error")]) == 1
    assert not marker.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make, needle", [
    (lambda d: d / "missing", "is not a folder"),
    (lambda d: (d / "f.txt").write_text("x") and d / "f.txt", "is not a folder"),
    (lambda d: d, "holds no model"),
    (lambda d: (d / "config.json").write_text("{}") and (d / "pytorch_model.bin").write_bytes(b"x") and d,
     "pickle weights only"),
    (lambda d: (d / "shardtune_checkpoint.json").write_text('{"complete": false}') and d,
     "not a complete shardtune checkpoint"),
])
def test_bad_target_is_one_line_exit_2(tmp_path, capsys, make, needle):
    rc, out, err = _generate(capsys, make(tmp_path))
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", [["--temperature", "-1"], ["--top-p", "0"], ["--max-new-tokens", "0"]])
def test_bad_option_is_one_line_exit_2(run, capsys, flag):
    from shardtune import cli

    rc = cli.main(["generate", str(run), "--prompt", "x", *flag])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err


@pytest.mark.timeout(120)
def test_system_message_and_a_template_that_refuses_it(tmp_path, capsys):
    """--system goes through the template as transformers renders it; a template that raises on a
    system turn is one line, exit 2 (the cut fixture: real weights, two layers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune import cli

    folder = cut_folder(2)
    assert cli.main(["generate", str(folder), "--prompt", QUESTION, "--system", "Answer in French.",
                     "--max-new-tokens", "12"]) == 0
    got = capsys.readouterr().out.strip()
    tok = AutoTokenizer.from_pretrained(folder)
    enc = tok.apply_chat_template([{"role": "system", "content": "Answer in French."},
                                   {"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=12)
    assert got == tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()

    strict = tmp_path / "strict"
    shutil.copytree(folder, strict)
    cfg = json.loads((strict / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                            "supported') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (strict / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert cli.main(["generate", str(strict), "--prompt", "hi", "--system", "x"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("shardtune: error")]
    assert len(errors) == 1 and "System role not supported" in errors[0] and "--system" in errors[0], err




@pytest.mark.timeout(300)
def test_a_lora_checkpoint_answers_as_peft_and_as_its_merged_export(shared_run, tmp_path, capsys):
    """A LoRA checkpoint holds adapters only: generate merges them onto the base. References: PEFT's
    own merge (`PeftModel.from_pretrained(base, adapter folder).merge_and_unload()`) for the weights
    and the answer, and the merged export loaded with transformers for the answer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune import cli
    from shardtune.config import ModelConfig
    from shardtune.train.core.model import build_hf_config, init_model_weights
    from shardtune.train.generation import load_for_generation

    run, _ = shared_run(LORA_RECIPE, "--lora-rank", "4", nproc=1)  # tests/e2e/test_lora_export.py's run
    ckpt = run / "checkpoints" / "step_4"
    assert cli.main(["export", str(ckpt), str(tmp_path / "adapter"), "--adapter-only"]) == 0
    assert cli.main(["export", str(ckpt), str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    capsys.readouterr()
    base = AutoModelForCausalLM.from_config(build_hf_config(ModelConfig()))
    init_model_weights(base, ModelConfig(), seed=0)  # the run's frozen base (train.seed 0)
    ref = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().eval()
    model, tok, _ = load_for_generation("checkpoint", ckpt)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-6, msg=k)
    trained = "model.layers.0.self_attn.q_proj.weight"  # a LoRA target: merged, so not the base
    assert not torch.allclose(got[trained], _fresh_base()[trained], atol=1e-4)
    tok = AutoTokenizer.from_pretrained(ckpt / "hf")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    for prompt in ("hello", "What is 2 + 3?"):
        rc, out, err = _generate(capsys, ckpt, prompt, 24)
        assert rc == 0, err
        assert out == _hf_answer(merged, tok, prompt, 24) == _hf_answer(ref, tok, prompt, 24), (prompt, out)


def _fresh_base() -> dict:
    from transformers import AutoModelForCausalLM

    from shardtune.config import ModelConfig
    from shardtune.train.core.model import build_hf_config, init_model_weights

    base = AutoModelForCausalLM.from_config(build_hf_config(ModelConfig()))
    init_model_weights(base, ModelConfig(), seed=0)
    return base.state_dict()
