"""LoRA in the trainer (train/core/lora.py) on gloo ranks, in ONE 2-rank launch of _train_worker.py
(its LoRA cases, and real-trainer cases for resume).

The reference is written here independently of train/core/lora.py: a plain transformers model (the
trainer's seeded base init), wrapped by PEFT's own `get_peft_model`, its A matrices set by hand
to U(-1/√in, 1/√in) from the per-tensor generator (= PEFT's kaiming_uniform_(a=√5), microsoft/LoRA
loralib), B zeros; one forward over the whole global batch, torch AdamW and clip_grad_norm_ on the
adapters alone.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _batches import global_batch

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_train_worker.py"
ROWS, SEQ, STEPS, LR = 8, 32, 3, 1e-2
RANK, ALPHA = 4, 8.0
LORA = {"rank": RANK, "alpha": ALPHA}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CKPT_BASE = ["model.name=tiny-llama", "data.generated_examples=200", "parallel.precision=fp32",
             "optim.lr=0.01", "train.seq_len=64", "train.max_steps=4", "train.micro_batch=2",
             "train.timeout_s=60", "checkpoint.every=2", "checkpoint.keep=3", f"lora.rank={RANK}",
             f"lora.alpha={ALPHA}"]


def _case(name, strategy, precision="fp32", **kw):
    par = {"strategy": strategy, "precision": precision, **kw.pop("parallel", {})}
    return {"name": name, "parallel": par, "steps": STEPS, "rows": ROWS, "seq_len": SEQ, "lr": LR,
            "lora": LORA, **kw}


def _plain_model():
    from transformers import AutoModelForCausalLM

    from shardtune.config import ModelConfig
    from shardtune.train.core.model import build_hf_config, init_model_weights

    model = AutoModelForCausalLM.from_config(build_hf_config(ModelConfig()), attn_implementation="sdpa")
    init_model_weights(model, ModelConfig(name="tiny-llama"), seed=0)
    return model


def _reference_model():
    """PEFT's own wrapper on the plain model; A by hand (module doc), B zeros."""
    from peft import LoraConfig, get_peft_model

    from shardtune.train.core.model import _tensor_seed

    model = get_peft_model(_plain_model(), LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                      target_modules=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name:
                gen = torch.Generator().manual_seed(_tensor_seed(0, name.removeprefix("base_model.model.")))
                bound = 1 / math.sqrt(p.shape[1])
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
            elif ".lora_B." in name:
                assert p.abs().max() == 0  # PEFT inits B to zeros too
    return model


def reference():
    torch.manual_seed(0)
    model = _reference_model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    losses, norms = [], []
    for step in range(STEPS):
        b = global_batch(step, ROWS, SEQ)
        logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, model


@pytest.fixture(scope="module")
def ref():
    return reference()


def world2_cases(d: Path) -> tuple[list[dict], float]:
    s2 = str(d / "lora_straight" / "checkpoints" / "step_2")
    cases = [
        _case("zero3", "zero3", logits=True, save_dir=str(d / "zero3_run")),
        _case("ddp", "ddp"),
        _case("zero1", "zero1"),
        _case("zero2", "zero2"),
        _case("zero3_offload", "zero3", parallel={"offload": "all"}),
        _case("zero3_bf16_ac", "zero3", "bf16-mixed", parallel={"activation_checkpointing": "full"}, steps=1),
        _case("ddp_bf16", "ddp", "bf16-mixed", steps=1),
        {"name": "lora_straight", "overrides": [*CKPT_BASE, "parallel.strategy=zero3", "checkpoint.resume=never"]},
        {"name": "lora_resume", "overrides": [*CKPT_BASE, "parallel.strategy=zero3", f"checkpoint.resume={s2}"]},
        {"name": "lora_resume_ddp", "overrides": [*CKPT_BASE, "parallel.strategy=ddp", f"checkpoint.resume={s2}"]},
    ]
    return cases, 240


def world4_cases(d: Path) -> tuple[list[dict], float]:
    cases = [_case("hsdp", "hsdp", parallel={"hsdp_shard_size": 2}),
             _case("hsdp_accum", "hsdp", parallel={"hsdp_shard_size": 2}, grad_accum=2)]
    return cases, 240


DIST_LAUNCHES = {2: world2_cases, 4: world4_cases}  # one shared launch per world (tests/dist/conftest.py)


@pytest.fixture(scope="module")
def launch2(dist_launch, request):
    return dist_launch(request.module, 2)


@pytest.mark.timeout(300, func_only=True)
@pytest.mark.parametrize("name", ["zero3", "ddp", "zero1", "zero2", "zero3_offload"])
def test_lora_loss_parity_two_ranks_vs_one_process(launch2, ref, name):
    for rank_result in launch2[1]:
        assert rank_result[name]["losses"] == pytest.approx(ref[0], abs=1e-5), name
        assert rank_result[name]["grad_norms"] == pytest.approx(ref[1], rel=1e-4), name


@pytest.mark.timeout(300, func_only=True)
@pytest.mark.parametrize("name", ["hsdp", "hsdp_accum"])
def test_lora_hsdp_2x2_vs_one_process(world4, ref, name):
    """hsdp: 2 replicas × 2 shards, with and without accumulation; the base stays frozen."""
    for rank_result in world4:
        assert rank_result[name]["losses"] == pytest.approx(ref[0], abs=1e-5), name
        assert rank_result[name]["grad_norms"] == pytest.approx(ref[1], rel=1e-4), name
        assert rank_result[name]["frozen_max_change"] == 0.0


@pytest.mark.timeout(300, func_only=True)
def test_initial_logits_are_the_base_models(launch2):
    """B = 0: before training, the LoRA model computes exactly the plain model."""
    ids = global_batch(99, 2, 16)["input_ids"]
    with torch.no_grad():
        want = _plain_model()(input_ids=ids).logits
    for rank_result in launch2[1]:
        torch.testing.assert_close(torch.tensor(rank_result["zero3"]["logits"]), want, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(300, func_only=True)
@pytest.mark.parametrize("name", ["zero3", "ddp", "zero1", "zero3_bf16_ac", "ddp_bf16"])
def test_base_frozen_and_only_adapters_get_grads(launch2, name):
    L = 4  # tiny-llama layers
    for rank_result in launch2[1]:
        r = rank_result[name]
        assert r["frozen_max_change"] == 0.0
        assert r["num_frozen"] == 3 + 9 * L  # embed, norm, lm_head + 9 per layer (test_train_parity)
        assert len(r["trainable_params"]) == 2 * len(TARGETS) * L
        assert all(".lora_A." in n or ".lora_B." in n for n in r["trainable_params"])
        # step 1: B = 0, so dL/dA = 0 but A's grad tensor exists; no base weight has one
        assert r["grad_params"] == r["trainable_params"]


def _lora_trainable_numel() -> int:
    """Hand derivation (tiny-llama: H 128, I 344, 2 KV heads × 32, L 4): r·(in + out) per target."""
    H, I, KV, L = 128, 344, 64, 4
    per_layer = (H + H) + (H + KV) + (H + KV) + (H + H) + 2 * (H + I) + (I + H)
    return L * RANK * per_layer


@pytest.mark.timeout(300, func_only=True)
@pytest.mark.parametrize("name, strategy, shard, precision", [
    ("zero3", "zero3", 2, "fp32"), ("ddp", "ddp", 1, "fp32"), ("zero1", "zero1", 1, "fp32"),
    ("zero2", "zero2", 2, "fp32"), ("ddp_bf16", "ddp", 1, "bf16-mixed"),
    ("zero3_bf16_ac", "zero3", 2, "bf16-mixed")])
def test_bytes_per_rank_equal_planner_with_lora(launch2, name, strategy, shard, precision):
    """After step 1 each rank's params (frozen base + adapters), grads (adapters only) and AdamW
    states (adapters only) equal plan/memory.py's `shardtune_states` for lora_rank (on CPU the
    `step` counters, the planner's `optimizer_host`, share the RAM with m and v)."""
    from shardtune.catalog.models import resolve_model_config
    from shardtune.plan.memory import shardtune_states
    from shardtune.plan.params import architecture_from_config, model_shapes

    shapes = model_shapes(architecture_from_config(resolve_model_config("tiny-llama")), lora_rank=RANK)
    assert sum(p.numel for p in shapes if p.trainable) == _lora_trainable_numel()
    for rank, rank_result in enumerate(launch2[1]):
        s = shardtune_states(shapes, strategy, 2, shard, precision, "adamw", rank)
        got = dict(rank_result[name]["bytes"])
        assert got == {"params_bytes": s.params, "grads_bytes": s.grads,
                       "optimizer_bytes": s.optimizer + s.optimizer_host}
        if strategy != "zero1":  # a `step` per adapter tensor (zero1: per owned one)
            assert s.optimizer_host == 4 * 2 * len(TARGETS) * 4
        if strategy == "zero3":  # and by hand: fp32 grads of half the adapters
            assert got["grads_bytes"] == 4 * _lora_trainable_numel() // 2
        if name == "ddp_bf16":  # by hand: under bf16-mixed the frozen base is bf16, adapters fp32
            base = sum(p.numel() for p in _plain_model().parameters())
            assert got["params_bytes"] == 2 * base + 4 * _lora_trainable_numel()


@pytest.mark.timeout(300, func_only=True)
def test_export_merged_and_adapter_load_with_the_trained_logits(launch2, tmp_path):
    """Merged export → AutoModelForCausalLM.from_pretrained, and the adapter folder →
    PeftModel.from_pretrained on the plain base: both give the trained model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardtune.train.durable.export import export_checkpoint

    d, results = launch2
    want = torch.tensor(results[0]["zero3"]["logits_after"])
    assert not torch.allclose(want, torch.tensor(results[0]["zero3"]["logits"]), atol=1e-3)  # trained
    ckpt = d / "zero3_run" / "checkpoints" / f"step_{STEPS}"
    ids = global_batch(99, 2, 16)["input_ids"]
    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, tmp_path / "merged"))
    cfg = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "shardtune_lora" not in cfg and not (tmp_path / "merged" / "adapter_config.json").exists()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    adapter = export_checkpoint(ckpt, tmp_path / "adapter", adapter_only=True)
    # the adapter files, and the export's own list of what it wrote (it replaces only those)
    assert sorted(p.name for p in adapter.iterdir()) == [".shardtune_export.json", "adapter_config.json",
                                                         "adapter_model.safetensors"]
    peft_model = PeftModel.from_pretrained(_plain_model(), adapter)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(300, func_only=True)
def test_checkpoint_holds_adapters_not_the_base(launch2):
    """The saved model tensors are the adapters alone (2 per target per layer); the base is a
    pointer in hf/config.json that names the seeded catalogue init and the training dtype."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from shardtune.train.durable.checkpoint import SafeFileSystemReader
    from shardtune.train.durable.export import model_tensors

    d, _ = launch2
    ckpt = d / "zero3_run" / "checkpoints" / f"step_{STEPS}"
    names = [name for _, name, _, _ in model_tensors(ckpt)]
    assert len(names) == 2 * len(TARGETS) * 4 and all(".lora_A." in n or ".lora_B." in n for n in names)
    md = SafeFileSystemReader(ckpt).read_metadata().state_dict_metadata
    nbytes = {sec: sum(v.size.numel() * v.properties.dtype.itemsize for k, v in md.items()
                       if k.startswith(sec + ".") and isinstance(v, TensorStorageMetadata))
              for sec in ("model", "optim")}
    # by hand, fp32: the adapters (4 B), their m and v (8 B) and one 4-byte `step` per adapter tensor
    assert nbytes == {"model": 4 * _lora_trainable_numel(), "optim": 8 * _lora_trainable_numel() + 4 * len(names)}
    base = json.loads((ckpt / "hf" / "config.json").read_text())["shardtune_lora"]["base"]
    assert base == {"model": "tiny-llama", "init": "random", "seed": 0, "dtype": "float32"}


@pytest.mark.timeout(60, func_only=True)
def test_resume_on_another_base_is_a_user_error():
    from types import SimpleNamespace

    from shardtune.errors import UserError
    from shardtune.train.core.lora import check_same_base

    saved = {"shardtune_lora": {"rank": 4, "base": {"model": "tiny-llama", "init": "random", "seed": 0}}}
    model = SimpleNamespace(config=SimpleNamespace(shardtune_lora={"rank": 4, "base": {
        "model": "tiny-llama", "init": "random", "seed": 1}}))
    with pytest.raises(UserError, match="same model.name, model.init and train.seed") as e:
        check_same_base(saved, model)
    assert "\n" not in str(e.value)
    model.config.shardtune_lora["base"]["seed"] = 0
    check_same_base(saved, model)  # the same base: no error


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.timeout(300, func_only=True)
@pytest.mark.parametrize("name", ["lora_resume", "lora_resume_ddp"])
def test_lora_resume_continues_the_straight_run(launch2, name):
    """4 steps straight == 2 steps, checkpoint, resume (same zero3 or resharded to ddp), 2 steps."""
    d, results = launch2
    assert results[0]["lora_straight"]["outcome"] == "ok" and results[0][name]["outcome"] == "ok"
    straight, resumed = _losses(d / "lora_straight"), _losses(d / name)
    assert sorted(resumed) == [3, 4]
    assert [resumed[s] for s in (3, 4)] == pytest.approx([straight[s] for s in (3, 4)], abs=1e-5)
    plan = json.loads((d / name / "plan.json").read_text())
    assert plan["inputs"]["lora_rank"] == RANK


@pytest.mark.timeout(60, func_only=True)
@pytest.mark.parametrize("override, needle", [
    ("lora.rank=-1", "lora.rank"), ("lora.alpha=0", "lora.alpha"), ("lora.dropout=1", "lora.dropout"),
    ("lora.target_modules=[]", "lora.target_modules"), ("lora.rnak=4", "did you mean 'lora.rank'")])
def test_bad_lora_settings_are_one_line_user_errors(override, needle):
    from shardtune.config import load_recipe
    from shardtune.errors import UserError

    with pytest.raises(UserError, match=needle) as e:
        load_recipe(None, [override])
    assert "\n" not in str(e.value)


@pytest.mark.timeout(60, func_only=True)
def test_unknown_target_module_is_a_user_error():
    from shardtune.config import LoraConfig, ModelConfig
    from shardtune.errors import UserError
    from shardtune.train.core.lora import apply_lora
    from shardtune.train.core.model import build_meta_model

    with pytest.raises(UserError, match="foo_proj") as e:
        apply_lora(build_meta_model(ModelConfig()), LoraConfig(rank=4, target_modules=["foo_proj"]))
    assert "\n" not in str(e.value)
