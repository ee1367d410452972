"""op activation checkpointing (torch's selective checkpoint, parallel/ac.py) on 2 gloo ranks, in
ONE launch of _ac_op_worker.py: the same model with no AC and with op AC in the same ranks, stepped
on the same batches for 4 steps. Recompute is exact, so fp32 losses and grad norms agree within
1e-6 under zero3 and ddp; bf16-mixed zero3 (FSDP2 casts the layer inputs in its hooks, which must
stay outside the selective region) runs and agrees within bf16's noise; op AC saves less than none.
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_ac_op_worker.py"


def _case(name, strategy, precision="fp32"):
    return {"name": name, "parallel": {"strategy": strategy, "precision": precision},
            "steps": 4, "rows": 8, "seq_len": 32}


CASES = [_case("zero3", "zero3"), _case("ddp", "ddp"), _case("zero3_bf16_mixed", "zero3", "bf16-mixed")]


DIST_LAUNCHES = {2: lambda d: (CASES, 300)}  # tests/dist/conftest.py


@pytest.mark.timeout(400, func_only=True)
@pytest.mark.parametrize("name", ["zero3", "ddp"])
def test_op_ac_equals_no_ac_fp32_over_4_steps(world2, name):
    for r in world2:
        c = r[name]
        assert c["op_losses"] == pytest.approx(c["none_losses"], abs=1e-6, rel=0)
        assert c["op_norms"] == pytest.approx(c["none_norms"], abs=1e-6, rel=1e-6)
        assert c["op_activation_bytes"] < c["none_activation_bytes"]


@pytest.mark.timeout(400, func_only=True)
def test_op_ac_runs_under_fsdp2_bf16_mixed(world2):
    for r in world2:
        c = r["zero3_bf16_mixed"]
        assert c["op_losses"] == pytest.approx(c["none_losses"], abs=1e-3, rel=0)
        assert c["op_activation_bytes"] < c["none_activation_bytes"]
