"""train.loss_chunks on 2 gloo ranks, in ONE launch of _chunked_loss_worker.py.

Each case builds the same model twice in the same ranks and steps both on the same batches over
4 steps: loss_chunks 1 (the full logits: its own parity with one process is
tests/dist/test_train_parity.py) is the reference for K chunks. zero3 is the FSDP2 pitfall (the
LM head's weight is a sharded DTensor outside the root's forward; its gradient must be
reduce-scattered), tied embeddings the SmolLM2 one (one weight, two uses), ddp the plain
wrapper, and ddp bf16-mixed the autocast path (bf16 matmuls in both: a looser tolerance).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.catalog.models import resolve_model_config

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_chunked_loss_worker.py"


def _case(name, strategy, precision="fp32", model="tiny-llama", chunks=4, grad_accum=1):
    return {"name": name, "parallel": {"strategy": strategy, "precision": precision}, "model": model,
            "chunks": chunks, "steps": 4, "rows": 8, "seq_len": 32, "grad_accum": grad_accum}


TOL = {"zero3": 1e-5, "zero3_tied_accum": 1e-5, "ddp": 1e-5, "ddp_bf16_mixed": 2e-2}


def world2_cases(d: Path) -> tuple[list[dict], float]:
    tied = dict(resolve_model_config("tiny-llama"), tie_word_embeddings=True)
    (d / "tied.json").write_text(json.dumps(tied))
    cases = [_case("zero3", "zero3"), _case("zero3_tied_accum", "zero3", model=str(d / "tied.json"), chunks=3,
                                            grad_accum=2),
             _case("ddp", "ddp"), _case("ddp_bf16_mixed", "ddp", precision="bf16-mixed")]
    return cases, 400


DIST_LAUNCHES = {2: world2_cases}  # one shared launch per world (tests/dist/conftest.py)


@pytest.mark.timeout(500, func_only=True)
@pytest.mark.parametrize("name", list(TOL))
def test_chunked_matches_full_logits_over_4_steps(world2, name):
    tol = TOL[name]
    for r in world2:
        c = r[name]
        k = next(int(key.split("_")[1]) for key in c if key.startswith("losses_") and key != "losses_1")
        assert c[f"losses_{k}"] == pytest.approx(c["losses_1"], abs=tol, rel=0)
        assert c[f"norms_{k}"] == pytest.approx(c["norms_1"], rel=tol)
        assert c[f"val_{k}"] == pytest.approx(c["val_1"], abs=tol, rel=0)
        assert c[f"param_sum_{k}"] == pytest.approx(c["param_sum_1"], rel=tol)
        assert c["losses_1"][-1] < c["losses_1"][0]  # it trains: a wrong gradient would show
        # the chunked path really ran: no full fp32 log-softmax (4 B × tokens × V) saved
        tokens = 8 // 2 * 32 // c["grad_accum"]
        assert c["saved_1"] - c[f"saved_{k}"] >= 4 * tokens * 264 - 4 * tokens
