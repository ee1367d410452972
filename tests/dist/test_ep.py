"""Expert parallelism (parallel/ep.py) on 2 gloo ranks, ep 2, in the shared 2-rank launch: the tiny
Mixtral (4 experts, top-2) with 2 experts a rank, tokens dispatched and combined by all-to-alls with
uneven splits, against the whole model in one process (transformers' loss with its aux loss) over 4
fp32 AdamW steps: losses and aux losses within 1e-5, every weight after the steps within 1e-4.
`forced`: every token's top-2 are experts 0 and 1 (rank 0's; weight ~1 on expert 0), so rank 1
receives nothing in every layer and still joins every collective (no hang, equal losses)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_ep_worker.py"
CASES = [{"name": n, "forced": n == "forced", "rows": 4, "seq_len": 32, "steps": 4} for n in ("routed", "forced")]
CASES += [{"name": "meta_fill", "meta_fill": True},
          {"name": "fsdp", "fsdp": True, "rows": 4, "seq_len": 32, "steps": 4},
          {"name": "a2a", "a2a": True, "rows": 2, "seq_len": 32}]
DIST_LAUNCHES = {2: lambda d: (CASES, 240)}  # one shared launch per world (tests/dist/conftest.py)


@pytest.mark.timeout(400, func_only=True)
@pytest.mark.parametrize("name", ["routed", "forced"])
def test_ep2_equals_one_process(world2, name):
    for r in (w[name] for w in world2):
        assert r["local_experts"] == 2
        assert r["whole_params"][0] == r["whole_params"][1]  # every expert counted, as the one-process model
        assert r["ep_loss"] == pytest.approx(r["ref_loss"], abs=1e-5, rel=0)
        assert r["ep_aux"] == pytest.approx(r["ref_aux"], abs=1e-5, rel=0)
        # weights: AdamW divides each gradient element by its own RMS, so an element whose gradient is
        # ~0 turns fp32 rounding into a visible step (measured up to 1.2e-5 after one step at lr 3e-3)
        assert r["expert_weight_diff"] < 1e-4 and r["other_weight_diff"] < 1e-4
    assert world2[0][name]["ref_loss"][-1] < world2[0][name]["ref_loss"][0]


@pytest.mark.timeout(400, func_only=True)
def test_routing_is_uneven_and_forced_leaves_a_rank_without_tokens(world2):
    routed = [w["routed"]["received"] for w in world2]
    assert all(n > 0 for ranks in routed for n in ranks)
    assert any(a != b for a, b in zip(*routed))  # uneven splits between the ranks
    forced = [w["forced"]["received"] for w in world2]
    assert all(n == 0 for n in forced[1]) and all(n > 0 for n in forced[0])


@pytest.mark.timeout(400, func_only=True)
def test_the_trainer_fill_gives_each_rank_its_experts_rows(world2):
    """meta build → apply_ep → to_empty → init_model_weights (train/core/model.py reads each rank's
    expert rows of the full seeded tensors): every weight equals the whole model's, exactly."""
    assert [w["meta_fill"]["meta_fill_diff"] for w in world2] == [0.0, 0.0]


@pytest.mark.timeout(400, func_only=True)
def test_ep2_under_zero3_through_the_trainer_step_equals_one_process(world2):
    """ep 2 x zero3 as docs/moe.md's wiring says (experts fully_shard on their own expert-FSDP mesh,
    gradient divided by the dp degree), stepped by train/core/step.py's train_step with clipping at 1.0
    (parallel/ep.py's per-mesh norm): one process's losses, aux losses and grad norms within 1e-5."""
    for r in (w["fsdp"] for w in world2):
        assert r["ep_loss"] == pytest.approx(r["ref_loss"], abs=1e-5, rel=0)
        assert r["ep_aux"] == pytest.approx(r["ref_aux"], abs=1e-5, rel=0)
        assert r["ep_norm"] == pytest.approx(r["ref_norm"], abs=1e-5, rel=1e-5)
    assert world2[0]["fsdp"]["ref_norm"][0] > 1.0  # the clip acted


@pytest.mark.timeout(400, func_only=True)
def test_ep_refuses_what_it_cannot_split(world2):
    uneven, dense = world2[0]["meta_fill"]["refusals"]
    assert "parallel.ep 2 does not divide the 3 experts" in uneven and "\n" not in uneven
    assert "parallel.ep needs a mixture-of-experts model" in dense


@pytest.mark.timeout(400, func_only=True)
def test_all_to_all_bytes_equal_the_planners(world2):
    """The send buffers of every dispatch and combine, forward and backward, summed over the ranks (a
    rank's combine and backward buffers hold the rows it received: uneven, but they sum to the rows
    sent) equal the planner's all-to-all payload (plan/ep.py, 4 x t x k x h x bytes per MoE layer a rank)
    times the ranks: fp32, t = 2 x 32 tokens a rank."""
    from shardtune.plan.ep import ep_collectives
    from shardtune.plan.model import _load_model

    arch = _load_model("tiny-mixtral", None, 0).arch
    planned = sum(op[1] for op in ep_collectives(arch, 2 * 32, 2, 4, "none"))
    calls = sum(op[3] for op in ep_collectives(arch, 2 * 32, 2, 4, "none"))
    got = [w["a2a"] for w in world2]
    assert sum(r["a2a_bytes"] for r in got) == 2 * planned, (got, planned)
    assert all(r["a2a_calls"] == calls for r in got)  # 4 a MoE layer: dispatch, combine, and their backwards
