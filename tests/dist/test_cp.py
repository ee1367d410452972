"""Context parallelism (all-to-all, parallel/cp.py) composed with FSDP2 against one plain process
(gloo, 4 ranks, one launch): cp 2 x dp 2 (zero3, zero2 with grad accumulation, hsdp, AC full, AC
op, chunked loss, bf16-mixed), tp 2 x cp 2 (KV heads repeated: 1 per tp rank, cp 2) and cp 4 x dp 1 (cp > KV
heads), fp32, 3 steps (LoRA 4), on `_batches`' packed rows (two documents a row, positions restarting) with
masked prompts. The reference is test_train_parity's: a plain transformers model on the whole
global batch, torch's cross_entropy, AdamW and clip_grad_norm_. LoRA at cp 2 x dp 2 is held to the
same LoRA run at cp 1 x dp 4 (tests/dist/test_lora.py holds that one to PEFT's). cp 2 x dp 1 runs
through the CLI: tests/e2e/test_cp_cli.py.

Documents: the full logits of two batches that differ in one document only, under cp 2 (row 0's
first document is cp rank 0's rows, its second cp rank 1's; the all-to-all brings both into one
attention, where a causal-only mask would let the second read the first): no other document's
logits move, and the unchanged batch's logits equal the plain model's.

Compile: cp 2 x dp 2 with train.compile on batches whose documents move every step and row
(`_cp_worker.varied_documents`, 4 steps) gives the same run eager's losses and grad norms within 1e-5 (as
tests/dist/test_compile.py holds compile to eager), with ONE dynamo graph for all layers and steps.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _cp_worker import changed_document_batches  # noqa: E402
from test_train_parity import ROWS, SEQ, STEPS, _plain_model, reference  # noqa: E402

pytestmark = [pytest.mark.dist]
WORKER = Path(__file__).parent / "_cp_worker.py"
# STEPS (3) is test_train_parity's: the first loss before any update, then two updates with the
# optimizer's sharded state carried over, as its parity cases of every strategy; the LoRA cases (whose
# check that the adapters learn was measured over 4) and the document-layout cases (4 layouts) run 4
LORA = {"rank": 4, "alpha": 8}
LONG = 4
PARITY = ["cp2_zero3", "cp2_zero2_accum", "cp2_hsdp", "cp2_acfull", "cp2_acop", "cp2_chunked_loss", "tp2_cp2",
          "cp4"]


def _case(name, cp=2, strategy="zero3", precision="fp32", **kw):
    par = {"strategy": strategy, "precision": precision, "cp": cp, **kw.pop("parallel", {})}
    return {"name": name, "parallel": par, "steps": kw.pop("steps", STEPS), "rows": ROWS, "seq_len": SEQ, **kw}


def world4_cases(d: Path) -> tuple[list[dict], float]:
    cases = [
        _case("cp2_zero3", logits=True),
        _case("cp2_zero2_accum", strategy="zero2", grad_accum=2),
        _case("cp2_hsdp", strategy="hsdp", parallel={"hsdp_shard_size": 1}),
        _case("cp2_acfull", parallel={"activation_checkpointing": "full"}),
        _case("cp2_acop", parallel={"activation_checkpointing": "op"}),
        _case("cp2_chunked_loss", loss_chunks=4),  # train.loss_chunks on each rank's rows
        _case("cp2_bf16mixed", precision="bf16-mixed"),
        _case("tp2_cp2", parallel={"tp": 2}),
        _case("cp4", cp=4),
        _case("cp2_lora", lora=LORA, lr=1e-2, steps=LONG),
        _case("cp1_lora", cp=1, lora=LORA, lr=1e-2, steps=LONG),
        _case("cp2_docs_eager", vary_docs=True, steps=LONG),
        _case("cp2_docs_compile", vary_docs=True, compile=True, steps=LONG),
    ]
    return cases, 500


DIST_LAUNCHES = {4: world4_cases}  # one shared launch per world (tests/dist/conftest.py)


@pytest.fixture(scope="module")
def ref():
    """The one-process run (test_train_parity's reference) at STEPS, once for every case."""
    return reference(steps=STEPS)


@pytest.mark.timeout(700, func_only=True)
@pytest.mark.parametrize("name", PARITY)
def test_cp_matches_one_process(world4, ref, name):
    want_losses, want_norms = ref
    for rank_result in world4:
        got = rank_result[name]
        assert got["losses"] == pytest.approx(want_losses, abs=1e-5), name
        assert got["grad_norms"] == pytest.approx(want_norms, rel=1e-4), name


@pytest.mark.timeout(700, func_only=True)
def test_layouts_are_what_the_cases_ask(world4):
    """Mesh (dp_replicate, dp_shard, cp, tp), tp innermost: ranks of a cp group read the same rows."""
    got = {name: [(r[name]["dp_rank"], r[name]["dp_size"], r[name]["cp"], r[name]["tp"]) for r in world4]
           for name in ("cp2_zero3", "tp2_cp2", "cp4")}
    assert got["cp2_zero3"] == [(0, 2, 2, 1), (0, 2, 2, 1), (1, 2, 2, 1), (1, 2, 2, 1)]
    assert got["tp2_cp2"] == [(0, 1, 2, 2)] * 4
    assert got["cp4"] == [(0, 1, 4, 1)] * 4


@pytest.mark.timeout(700, func_only=True)
def test_bf16_mixed_close(world4, ref):
    want, _ = ref
    got = world4[0]["cp2_bf16mixed"]["losses"]
    assert got == pytest.approx(want, abs=2e-2)
    assert got != pytest.approx(want, abs=1e-7)  # bf16 compute really used


@pytest.mark.timeout(700, func_only=True)
def test_lora_under_cp_matches_cp1(world4):
    for rank_result in world4:
        want = rank_result["cp1_lora"]
        assert rank_result["cp2_lora"]["losses"] == pytest.approx(want["losses"], abs=1e-5)
        assert rank_result["cp2_lora"]["grad_norms"] == pytest.approx(want["grad_norms"], rel=1e-4)
    assert want["losses"][-1] < want["losses"][1]


@pytest.mark.timeout(700, func_only=True)
def test_a_document_never_attends_to_another(world4):
    """Row 0's first document (tokens 0..15: cp rank 0's piece) changed: the second document's
    logits (cp rank 1's piece, after it in the row) and row 1's stay bit for bit, the changed
    document's move; and the unchanged batch's logits equal the plain model's (transformers' own
    packed-sequence mask)."""
    same, changed = (torch.tensor(x) for x in world4[0]["cp2_zero3"]["logits"])
    half = SEQ // 2
    assert torch.equal(same[0, half:], changed[0, half:])
    assert torch.equal(same[1], changed[1])
    assert (same[0, :half] - changed[0, :half]).abs().amax(-1).min() > 1e-3  # every changed token moved
    for rank_result in world4[1:]:
        assert torch.equal(torch.tensor(rank_result["cp2_zero3"]["logits"][0]), same)
    torch.manual_seed(0)
    plain = _plain_model()
    batch, _ = changed_document_batches(2, SEQ)
    with torch.no_grad():
        want = plain(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    assert (same - want).abs().max() < 1e-5


@pytest.mark.timeout(700, func_only=True)
def test_compiled_cp_matches_eager_and_compiles_once(world4):
    """The documents reach the compiled layer as a tensor (parallel/cp.py's `shardtune::cp_attend`
    op), not as a list of ints dynamo guards on: that recompiled every layer at every step."""
    for rank_result in world4:
        eager, comp = rank_result["cp2_docs_eager"], rank_result["cp2_docs_compile"]
        assert comp["losses"] == pytest.approx(eager["losses"], abs=1e-5, rel=0)
        assert comp["grad_norms"] == pytest.approx(eager["grad_norms"], rel=1e-5)
        assert eager["graphs_after"] == eager["graphs_before"]  # the eager cases compiled nothing
        assert comp["graphs_after"] - comp["graphs_before"] == 1  # 4 layers x 4 steps, 4 document layouts
