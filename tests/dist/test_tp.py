"""Tensor (+ sequence) parallelism composed with FSDP2 against one plain process (gloo, 4 ranks, the
tier's shared 4-rank launch, tests/dist/conftest.py): tp 2 × dp 2 (zero3, zero2 with grad
accumulation, hsdp, AC full without SP, AC op, AC full with SP, bf16-mixed, LoRA with and without
SP) and tp 4 × dp 1, fp32, 3 steps (LoRA 4), on `_batches`' packed rows with masked prompts. The
reference is test_train_parity's: a plain transformers model on the whole global batch, torch's
cross_entropy, AdamW and clip_grad_norm_ (tp 2 × dp 1 runs through the CLI: tests/e2e/test_tp_cli.py).

Collectives (torch's CommDebugMode, bytes added: _comm_count.py) of one tp 2 × dp 2 step against a
hand count of the TP plan (docs/parallelism.md): per decoder layer, with SP, forward all-gathers the
(b, s, h) input of attention and MLP and reduce-scatters their outputs, backward the reverse; plus
the head's all-gather (forward) / reduce-scatter (backward), layer 0's sequence split (all-gather of
its gradient), the embedding's all-reduce, loss_parallel's three all-reduces of (b·s) fp32 values,
one all-reduce per SP norm weight's gradient and one for the grad norm.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_train_parity import ROWS, SEQ, STEPS, reference

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_tp_worker.py"
# STEPS (3) is test_train_parity's: the first loss before any update, then two updates with the
# optimizer's sharded state carried over, as its parity cases of every strategy; LoRA cases run 4
# steps, as their check that the adapters learn (B starts at 0) was measured over
LORA = {"rank": 4, "alpha": 8}
LORA_STEPS = 4
TINY = dict(V=264, h=128, I=344, L=4)  # tiny-llama (catalog/models.py), untied, 2 KV heads of 32


def _case(name, tp=2, strategy="zero3", precision="fp32", **kw):
    par = {"strategy": strategy, "precision": precision, "tp": tp, **kw.pop("parallel", {})}
    return {"name": name, "parallel": par, "steps": kw.pop("steps", STEPS), "rows": ROWS, "seq_len": SEQ, **kw}


def _kv4_config(tmp: Path) -> Path:
    """tiny-llama with 4 KV heads: tp 4 must divide them (2 do not: the check refuses it)."""
    from shardtune.catalog.models import resolve_model_config

    cfg = resolve_model_config("tiny-llama")
    cfg["num_key_value_heads"] = 4
    path = tmp / "kv4.json"
    path.write_text(json.dumps(cfg))
    return path


def world4_cases(tmp: Path) -> tuple[list[dict], float]:
    kv4 = _kv4_config(tmp)
    cases = [
        _case("tp2_zero3", comm=True),
        _case("tp2_zero2_accum", strategy="zero2", grad_accum=2),
        _case("tp2_hsdp", strategy="hsdp", parallel={"hsdp_shard_size": 1}),
        _case("tp2_nosp_acfull", parallel={"sequence_parallel": False, "activation_checkpointing": "full"}),
        _case("tp2_acop", parallel={"activation_checkpointing": "op"}),
        _case("tp2_acfull", parallel={"activation_checkpointing": "full"}),  # with SP: layer 0 recomputed
        _case("tp2_bf16mixed", precision="bf16-mixed"),
        _case("tp4", tp=4, model={"name": str(kv4)}),
        _case("tp2_lora", lora=LORA, lr=1e-2, steps=LORA_STEPS),
        _case("tp2_lora_nosp", parallel={"sequence_parallel": False}, lora=LORA, lr=1e-2, steps=LORA_STEPS),
        _case("tp1_lora", tp=1, lora=LORA, lr=1e-2, steps=LORA_STEPS),
    ]
    return cases, 400


DIST_LAUNCHES = {4: world4_cases}  # one shared launch per world (tests/dist/conftest.py)


@pytest.fixture(scope="module")
def world4(dist_launch, request):
    d, results = dist_launch(request.module, 4)
    return results, d / "kv4.json"


def _reference_kv4(kv4: Path) -> list[float]:
    """test_train_parity's reference loop on the 4-KV-head model, seeded as the trainer inits it."""
    from transformers import AutoModelForCausalLM

    from shardtune.config import ModelConfig
    from shardtune.train.core.model import build_hf_config, init_model_weights

    mcfg = ModelConfig(name=str(kv4))
    model = AutoModelForCausalLM.from_config(build_hf_config(mcfg), attn_implementation="sdpa")
    init_model_weights(model, mcfg, seed=0)
    return reference(steps=STEPS, model=model)[0]


@pytest.fixture(scope="module")
def ref():
    """test_train_parity's one-process reference at STEPS steps, once for every case here."""
    return reference(steps=STEPS)


@pytest.mark.timeout(600, func_only=True)
@pytest.mark.parametrize("name", ["tp2_zero3", "tp2_zero2_accum", "tp2_hsdp", "tp2_nosp_acfull", "tp2_acop",
                                  "tp2_acfull"])
def test_tp2_dp2_matches_one_process(world4, ref, name):
    want_losses, want_norms = ref
    for rank_result in world4[0]:
        got = rank_result[name]
        assert got["dp_size"] == 2
        assert got["losses"] == pytest.approx(want_losses, abs=1e-5), name
        assert got["grad_norms"] == pytest.approx(want_norms, rel=1e-4), name
    assert [r[name]["dp_rank"] for r in world4[0]] == [0, 0, 1, 1]  # TP innermost: ranks 0, 1 share rows


@pytest.mark.timeout(600, func_only=True)
def test_tp4_matches_one_process(world4):
    results, kv4 = world4
    want = _reference_kv4(kv4)
    for rank_result in results:
        assert rank_result["tp4"]["dp_size"] == 1
        assert rank_result["tp4"]["losses"] == pytest.approx(want, abs=1e-5)


@pytest.mark.timeout(600, func_only=True)
def test_tp2_bf16_mixed_close(world4, ref):
    want, _ = ref
    got = world4[0][0]["tp2_bf16mixed"]["losses"]
    assert got == pytest.approx(want, abs=2e-2)
    assert got != pytest.approx(want, abs=1e-7)  # bf16 compute really used


def _tp_collectives(b: int, s: int, h: int, L: int, e: int = 4) -> dict:
    """{op: [count, bytes]} on the tp group for one step, hand-counted (module docstring)."""
    act = b * s * h * e  # one (b, s, h) activation
    tokens = b * s * 4  # loss_parallel: max, sum of exp, target logit per token (fp32)
    norms = 2 * L + 1  # SP norm weights: their gradient is a partial sum over the sequence shards
    return {"all_gather_into_tensor": [(2 * L + 1) * 2, (2 * L + 1) * 2 * act],
            "reduce_scatter_tensor": [2 * L + 2 * L + 1, (4 * L + 1) * act],
            "all_reduce": [1 + 3 + norms + 1, act + 3 * tokens + norms * h * 4]}  # bytes: bar the grad norm's


@pytest.mark.timeout(600, func_only=True)
def test_tp_collectives_per_step_match_the_hand_count(world4):
    b, s, h, L = ROWS // 2, SEQ, TINY["h"], TINY["L"]  # per dp rank: 4 rows of 32
    want = _tp_collectives(b, s, h, L)
    got = world4[0][0]["tp2_zero3"]["comm"]["tp"]
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        assert got[op] == want[op], (op, got[op], want[op])
    n, nbytes = got["all_reduce"]
    assert n == want["all_reduce"][0]
    # the grad norm's all-reduce: one fp32 value per parameter tensor that the mesh splits (a few
    # hundred bytes; torch's foreach norm decides the grouping), beside 130 KB of activations
    assert 0 < nbytes - want["all_reduce"][1] < 512
    if os.environ.get("SHARDTUNE_TP_COMM_JSON"):  # for the planner's comparison (BENCHMARKS.md)
        Path(os.environ["SHARDTUNE_TP_COMM_JSON"]).write_text(json.dumps(
            {"case": "tiny-llama tp 2 x dp 2 zero3 fp32, one step, per rank", "b": b, "s": s, "h": h, "L": L,
             "measured": world4[0][0]["tp2_zero3"]["comm"], "hand_count_tp": want}, indent=1))


@pytest.mark.timeout(600, func_only=True)
def test_state_bytes_per_rank_are_params_over_tp_times_dp_shard(world4):
    """fp32 AdamW states of tp 2 × dp_shard 2: every weight split 4 ways, the SP norm weights
    (replicated over tp) 2 ways; m and v 8 B/param, + a 4-byte `step` per tensor."""
    V, h, I, L = TINY["V"], TINY["h"], TINY["I"], TINY["L"]
    kv = 2 * 32
    norms = (2 * L + 1) * h
    split = 2 * V * h + L * (2 * h * h + 2 * h * kv + 3 * h * I)
    params = split // 4 + norms // 2
    tensors = 3 + 9 * L
    for rank_result in world4[0]:
        got = rank_result["tp2_zero3"]["bytes"]
        assert got["params_bytes"] == 4 * params
        assert got["grads_bytes"] == 4 * params
        assert got["optimizer_bytes"] == 8 * params + 4 * tensors


@pytest.mark.timeout(600, func_only=True)
@pytest.mark.parametrize("name", ["tp2_lora", "tp2_lora_nosp"])
def test_lora_on_tp_split_linears_matches_tp1(world4, name):
    """LoRA adapters on the TP-split projections (A whole and B split on column-parallel ones, A
    split and B whole on row-parallel ones; the frozen base and norms stay frozen) against the
    same LoRA run at tp 1 × dp 4 (tests/dist/test_lora.py holds that one to PEFT's)."""
    for rank_result in world4[0]:
        want = rank_result["tp1_lora"]
        assert rank_result[name]["losses"] == pytest.approx(want["losses"], abs=1e-5)
        assert rank_result[name]["grad_norms"] == pytest.approx(want["grad_norms"], rel=1e-4)
    assert want["losses"][-1] < want["losses"][1]  # the adapters learn (B starts at 0: step 1 is the base's)
