"""LoRA and DPO on the tiny Mixtral (recipes/tiny-moe-cpu.yaml, 4 experts, top-2, fp32) as a user runs
them, each 2-process run against one process with the same 8-row global batch over 4 steps:
- LoRA on the attention (q, k, v, o: the default targets) and on the experts' 3-D weights
  (`lora.target_parameters`, PEFT's ParamWrapper) under zero3: loss, aux_loss, grad_norm and
  expert_load_cv within 1e-5; the merged export (`checkpoint.export_hf`) loads in transformers with
  0 missing / unexpected keys, and PEFT's own `PeftModel.from_pretrained(base, adapter-only export)`
  gives its logits; each rank's parameter, gradient and optimizer bytes (memory.json, the trainer's
  storage count) equal the plan the run wrote (plan.json: plan/params.py `expert_lora_shapes`), to
  the byte;
- LoRA on q/v under expert parallelism (`--ep 2`): the same metrics as one process without ep, and
  its merged export gives one process's export's logits;
- `train.objective: dpo` (tiny date pairs): 2 processes and `--ep 2` give one process's loss, reward
  metrics, aux_loss and grad_norm.
- the other MoE classes as a user trains them (`model.name=tiny-qwen3-moe`, `model.name=tiny-gpt-oss`):
  `--nproc 2 --ep 2` (zero3 for the rest) gives one process's loss, aux_loss, grad_norm and
  expert_load_cv within 1e-5, and both runs' `checkpoint.export_hf` load in transformers with 0
  missing / unexpected keys and give the same logits.
The runs are made once for the test run (tests/_cli.py `once`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _cli import REPO, metrics, once, shardtune_cli, shared_root

pytestmark = [pytest.mark.e2e]
RECIPE = REPO / "recipes" / "tiny-moe-cpu.yaml"
EXPERTS = "lora.target_parameters=[experts.gate_up_proj,experts.down_proj]"
SAVED = ["checkpoint.save_final=true", "checkpoint.export_hf=true"]
LORA = ["lora.rank=8", "lora.target_modules=[q_proj,v_proj]", *SAVED]
# the experts' adapters with the default attention targets (q, k, v, o)
LORA_EXPERTS = ["lora.rank=8", *SAVED, EXPERTS]
MODELS = ("qwen3-moe", "gpt-oss")  # catalogue entries tiny-qwen3-moe, tiny-gpt-oss
DPO = ["train.objective=dpo", "data.path={tmp}/pairs.jsonl", "data.packing=false", "train.seq_len=128"]
RUNS = {
    "lora1": ["--nproc", "1", "train.micro_batch=8", *LORA_EXPERTS],
    "lora2": ["--nproc", "2", *LORA_EXPERTS],
    "attn1": ["--nproc", "1", "train.micro_batch=8", *LORA],
    "attn_ep2": ["--nproc", "2", "--ep", "2", *LORA],
    "dpo1": ["--nproc", "1", "train.micro_batch=4", *DPO],
    "dpo2": ["--nproc", "2", "train.micro_batch=2", *DPO],
    "dpo_ep2": ["--nproc", "2", "--ep", "2", "train.micro_batch=2", *DPO],
    **{f"{m}{suffix}": [*args, f"model.name=tiny-{m}", "checkpoint.export_hf=true"] for m in MODELS
       for suffix, args in (("_1", ["--nproc", "1", "train.micro_batch=8"]), ("_ep2", ["--nproc", "2", "--ep", "2"]))},
}
DATES = ["2017-03-09", "1999-12-31", "2041-07-04", "1988-02-15", "2003-10-21", "2025-06-30", "1970-01-02",
         "2012-11-08", "1995-05-27", "2033-09-13", "2008-04-19", "1961-08-25", "2020-02-29", "2050-12-01",
         "1977-03-16", "2001-09-05"]
KEYS = ("loss", "aux_loss", "grad_norm", "expert_load_cv")


def _build(tmp: Path) -> dict:
    with open(tmp / "pairs.jsonl", "w") as f:
        for d in DATES:
            y, m, dd = d.split("-")
            f.write(json.dumps({"prompt": f"Write {d} as DD/MM/YYYY.", "chosen": f"{dd}/{m}/{y}",
                                "rejected": f"{m}/{dd}/{y}"}) + "\n")
    out = {}
    for name, args in RUNS.items():
        proc = shardtune_cli("train", RECIPE, "--output-dir", tmp / name, *[a.format(tmp=tmp) for a in args],
                             timeout_s=300)
        assert proc.returncode == 0, proc.stdout[-3000:]
        out[name] = str(tmp / name)
    return {"runs": out, "readonly": list(out.values())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    return {k: Path(v) for k, v in once(shared_root(tmp_path_factory), ["moe-lora", RUNS], _build)["runs"].items()}


def _same(a: Path, b: Path, keys=KEYS) -> None:
    one, two = metrics(a), metrics(b)
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    for key in keys:
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], abs=1e-5), key


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("one, two", [("lora1", "lora2"), ("attn1", "attn_ep2")])
def test_lora_on_two_processes_gives_one_process_metrics(runs, one, two):
    _same(runs[one], runs[two])
    assert metrics(runs[one])[-1]["loss"] < metrics(runs[one])[0]["loss"] - 0.1  # the adapters learn


@pytest.mark.timeout(1500)
def test_expert_lora_states_per_rank_equal_the_planners(runs):
    """The zero3 run with the experts' adapters: the planner's trainable count and per-rank states
    against the trainer's. Before the planner counted the expert adapters, the gradients were planned
    at 0.11 MiB against 0.37 MiB measured."""
    plan = json.loads((runs["lora2"] / "plan.json").read_text())
    # per layer, rank 8: q, o (128 -> 128) 8 x 256 = 2,048 each, k, v (128 -> 64) 8 x 192 = 1,536 each;
    # the experts' (gate_up 12,288 + down 8,192); tiny-mixtral's 4 layers
    assert plan["model"]["trainable_params"] == 4 * (2 * 2048 + 2 * 1536 + 12288 + 8192)
    planned = plan["strategies"][0]["memory"]
    ranks = json.loads((runs["lora2"] / "memory.json").read_text())["per_rank"]
    assert len(ranks) == 2
    for rank in ranks:
        for key in ("params", "grads", "optimizer"):
            assert rank[f"{key}_bytes"] == planned[key], (key, rank[f"{key}_bytes"], planned[key])


def test_the_ranks_say_which_modules_and_parameters_they_adapted(runs):
    """memory.json `effective` read back from PEFT's layers (train/core/effective.py), against the recipe."""
    for run, modules, params in (("lora2", ["k_proj", "o_proj", "q_proj", "v_proj"],
                                  ["experts.down_proj", "experts.gate_up_proj"]), ("attn1", ["q_proj", "v_proj"], [])):
        eff = json.loads((runs[run] / "memory.json").read_text())["effective"]
        assert (sorted(eff["lora_target_modules"]), eff["lora_target_parameters"]) == (modules, params), run


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.timeout(1500)
def test_expert_lora_exports_load_merged_and_as_a_peft_adapter(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardtune import cli
    from shardtune.config import ModelConfig
    from shardtune.train.core.model import build_hf_config, init_model_weights

    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    merged = {}
    for name in ("lora1", "lora2"):
        model, info = AutoModelForCausalLM.from_pretrained(runs[name] / "hf_export", output_loading_info=True)
        assert not any(info.values()), info  # 0 missing / unexpected keys
        merged[name] = _logits(model.eval(), ids)
    torch.testing.assert_close(merged["lora2"], merged["lora1"], atol=1e-4, rtol=0)
    adapter = tmp_path / "adapter"
    # `shardtune export` in this process (as tests/e2e/test_lora_export.py): no interpreter start-up
    assert cli.main(["export", str(runs["lora2"] / "checkpoints" / "step_4"), str(adapter), "--adapter-only"]) == 0
    assert json.loads((adapter / "adapter_config.json").read_text())["target_parameters"] == [
        "experts.gate_up_proj", "experts.down_proj"]
    cfg = ModelConfig(name="tiny-mixtral", init="random")
    base = AutoModelForCausalLM.from_config(build_hf_config(cfg), experts_implementation="grouped_mm")
    init_model_weights(base, cfg, seed=0)  # the run's frozen base (train.seed 0)
    peft = PeftModel.from_pretrained(base, adapter).eval()
    torch.testing.assert_close(_logits(peft, ids), merged["lora2"], atol=1e-5, rtol=1e-5)
    with peft.disable_adapter():  # the experts' adapters did train: without them the logits move
        assert (_logits(peft, ids) - merged["lora2"]).abs().max() > 1e-2
    peft.base_model.model.model.layers[0].mlp.experts.lora_B["default"].weight.data.zero_()
    assert (_logits(peft, ids) - merged["lora2"]).abs().max() > 1e-4  # one expert weight's adapter counts


@pytest.mark.timeout(1500)
def test_attention_lora_under_ep_exports_one_process_model(runs):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    got = {}
    for name in ("attn1", "attn_ep2"):
        model, info = AutoModelForCausalLM.from_pretrained(runs[name] / "hf_export", output_loading_info=True)
        assert not any(info.values()), info
        got[name] = _logits(model.eval(), ids)
    torch.testing.assert_close(got["attn_ep2"], got["attn1"], atol=1e-4, rtol=0)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("two", ["dpo2", "dpo_ep2"])
def test_dpo_on_the_moe_gives_one_process_metrics_with_the_aux_loss(runs, two):
    _same(runs["dpo1"], runs[two], keys=("loss", "aux_loss", "grad_norm", "reward_acc", "reward_margin"))


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("model", MODELS)
def test_qwen3_moe_and_gpt_oss_under_ep_give_one_process_run_and_export(runs, model):
    from transformers import AutoModelForCausalLM

    _same(runs[f"{model}_1"], runs[f"{model}_ep2"])
    assert metrics(runs[f"{model}_1"])[-1]["loss"] < metrics(runs[f"{model}_1"])[0]["loss"] - 0.5  # it learns
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    got = {}
    for name in (f"{model}_1", f"{model}_ep2"):
        hf, info = AutoModelForCausalLM.from_pretrained(runs[name] / "hf_export", output_loading_info=True)
        assert not any(info.values()), info  # 0 missing / unexpected keys
        assert hf.config.model_type == model.replace("-", "_")
        got[name] = _logits(hf.eval(), ids)
    torch.testing.assert_close(got[f"{model}_ep2"], got[f"{model}_1"], atol=1e-4, rtol=0)
