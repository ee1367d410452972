"""`plan --simulate`: the analytic planner against the trainer's step traced on fake tensors.

The reduced model keeps Llama-3-8B's real widths (hidden 4096, 32 heads, 8 KV heads, FFN 14336,
vocabulary 128256) with 2 layers, at seq 512 and N = 8 (zero3, bf16-mixed, micro-batch 1).
Tolerances are the issue's: model states within 2 %, activations and peak within 10 %.
The simulator's own correctness against real tensors is tests/dist/test_simulate_vs_real.py.
"""
from __future__ import annotations

import contextlib
import json

import pytest
from _tolerance import assert_plan_within_trace

from shardtune.catalog.models import MODELS
from shardtune.cli import main
from shardtune.plan.validate import PlanInputs

N = 8


def _reduced_8b() -> dict:
    cfg = dict(MODELS["llama-3-8b"]["config"])
    cfg["num_hidden_layers"] = 2
    return cfg


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ac", ["none", "full"])
def test_analytic_within_tolerance_of_simulated_reduced_llama3_8b(ac):
    from shardtune.plan import plan
    from shardtune.verify.simulate import simulate_strategy

    cfg = _reduced_8b()
    sim = simulate_strategy(PlanInputs(cfg, N, seq_len=512, ac=ac), "zero3")
    mem = plan(cfg, gpus=N, seq_len=512, ac=ac, strategies=["zero3"]).strategy("zero3").memory
    # the states also have a closed form (FSDP2: 4 B fp32 params, 4 B grads, 8 B Adam per
    # parameter, dim 0 padded to a multiple of N; (rows, row size) below): the trace must give it too
    h, v, f, kv, L = 4096, 128256, 14336, 1024, 2
    rows = [(v, h), (v, h), (h, 1)] + L * [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h, 1), (h, 1)]
    shard_numel = sum(-(-r // N) * c for r, c in rows)
    assert sim["params"] == 4 * shard_numel
    assert sim["grads"] == 4 * shard_numel
    assert abs(sim["optimizer"] - 8 * shard_numel) <= 8 * (len(rows) + 1)  # + the per-tensor `step` scalars
    assert_plan_within_trace(mem, sim)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_analytic_within_tolerance_of_simulated_other_strategies(strategy):
    # ddp/zero1 train an fp32 model under torch.autocast (fp32 residual stream and norms), zero2
    # keeps every layer unsharded from forward to backward: different paths from zero3's
    from shardtune.plan import plan
    from shardtune.verify.simulate import simulate_strategy

    cfg = _reduced_8b()
    sim = simulate_strategy(PlanInputs(cfg, N, seq_len=512), strategy)
    mem = plan(cfg, gpus=N, seq_len=512, strategies=[strategy]).strategy(strategy).memory
    assert_plan_within_trace(mem, sim)
    if strategy != "zero2":
        # by hand, the head's backward under autocast (vocabulary 128256 > 32k: 8 loss chunks): the
        # layers' cached bf16 weights, the head's dW in bf16 and its fp32 cast (head not cached)
        h, v, f, kv = 4096, 128256, 14336, 1024
        layer_2d = 2 * h * h + 2 * kv * h + 3 * f * h
        assert sim["buffers"] == pytest.approx(2 * 2 * layer_2d + (2 + 4) * v * h, rel=0.01)


@pytest.mark.timeout(60)
def test_fake_process_group_is_torn_down_and_strategies_trace_in_one_process():
    import torch.distributed as dist

    from shardtune.verify.simulate import simulate_strategy

    a = simulate_strategy(PlanInputs("tiny-llama", 4, seq_len=32), "zero3")
    b = simulate_strategy(PlanInputs("tiny-llama", 4, seq_len=32), "ddp")
    assert not dist.is_initialized()
    # hand derivation: ddp holds every parameter; zero3 a quarter (tiny-llama's dims divide by 4)
    assert b["params"] == 4 * a["params"]
    assert a["total"] < b["total"]


@pytest.mark.parametrize("argv,reason", [
    (["--offload", "all"], "offload all"),
    (["--lora-rank", "8"], "LoRA"),
    (["--optimizer", "sgd"], "optimizer sgd"),
])
def test_untraceable_option_falls_back_to_analytic_in_one_line(argv, reason, capsys):
    rc = main(["plan", "tiny-llama", "--gpus", "2", "--simulate", "--json", *argv])
    out, err = capsys.readouterr()
    assert rc == 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot trace" in lines[0] and reason in lines[0], err
    doc = json.loads(out)
    for s in doc["strategies"]:
        assert s["simulated"]["status"] == "analytic fallback"
        assert s["memory"]["total"] > 0  # the analytic plan is still there


@pytest.mark.timeout(120)
def test_cli_simulate_json_has_simulated_memory_keys(capsys):
    rc = main(["plan", "tiny-llama", "--gpus", "2", "--seq-len", "64", "--strategy", "zero2", "--simulate", "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0
    s = json.loads(out)["strategies"][0]
    assert s["simulated"]["status"] == "traced"
    assert set(s["memory"]) <= set(s["simulated"])
    assert s["simulated"]["params"] == s["memory"]["params"]  # FSDP2 shard bytes: both exact


def test_plan_table_shows_simulated_beside_analytic(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "140")  # the whole table (test_plan_width: the compact one at 80)
    rc = main(["plan", "tiny-llama", "--gpus", "2", "--seq-len", "64", "--strategy", "zero3", "--simulate"])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "Analytic vs simulated" in out and "Δ sim vs analytic" in out


@pytest.mark.timeout(120)
def test_grad_accum_2_traces_with_grads_kept_across_micro_batches():
    # train_step with grad_accum 2 runs the root module's forward twice under one tracker, which
    # torch's trackers refused ("multiple iterative calls"). FSDP2 accumulates into the sharded
    # grads, so the first micro-batch's grads are alive through the second one.
    from shardtune.plan import plan
    from shardtune.verify.simulate import simulate_strategy

    cfg = _reduced_8b()
    one = simulate_strategy(PlanInputs(cfg, N, seq_len=512, grad_accum=1), "zero3")
    two = simulate_strategy(PlanInputs(cfg, N, seq_len=512, grad_accum=2), "zero3")
    for key in ("params", "grads", "optimizer", "activations"):  # per micro-batch: the same
        assert two[key] == pytest.approx(one[key], rel=1e-4), key
    # Both peaks are the end of backward (the root group's reduce-scatter). By hand: the root's own
    # fp32 grad shard (embedding and LM head: ceil(128256/8) rows of 4096, the norm: 4096/8) is
    # not there yet with one micro-batch (zero_grad(set_to_none=True) freed it; the reduce-scatter
    # makes it), but is there with two: the first micro-batch made it.
    root_shard_bytes = 4 * (2 * -(-128256 // N) * 4096 + 4096 // N)
    assert one["breakdown_at_peak"]["Sharded Grad"] == one["grads"] - root_shard_bytes
    assert two["breakdown_at_peak"]["Sharded Grad"] == two["grads"]
    assert two["total"] - one["total"] == pytest.approx(root_shard_bytes, rel=1e-4)
    mem = plan(cfg, gpus=N, seq_len=512, grad_accum=2, strategies=["zero3"]).strategy("zero3").memory
    assert mem.total == pytest.approx(two["total"], rel=0.10)


@pytest.mark.timeout(120)
def test_cli_simulate_grad_accum_2_traces_every_strategy(capsys):
    rc = main(["plan", "tiny-llama", "--gpus", "2", "--seq-len", "32", "--grad-accum", "2", "--simulate", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "cannot trace" not in err, err
    for s in json.loads(out)["strategies"]:
        assert s["simulated"]["status"] == "traced", (s["name"], s["simulated"])
        assert s["simulated"]["params"] == s["memory"]["params"], s["name"]


@pytest.mark.timeout(120)
def test_ddp_grad_accum_2_holds_a_second_copy_of_the_grads():
    # DDP (gradient_as_bucket_view=True): zero_grad(set_to_none=True) drops the bucket views, so
    # the no_sync micro-batch accumulates into fresh grads; the last backward copies them into the
    # buckets, which stay allocated: by hand, two copies of the fp32 grads at the peak.
    from shardtune.plan import plan
    from shardtune.verify.simulate import simulate_strategy

    cfg = _reduced_8b()
    sim = simulate_strategy(PlanInputs(cfg, N, seq_len=512, grad_accum=2), "ddp")
    assert sim["grads"] == 4 * sum(p for p in _reduced_8b_numels())
    assert sim["breakdown_at_peak"]["Gradient"] == 2 * sim["grads"]
    mem = plan(cfg, gpus=N, seq_len=512, grad_accum=2, strategies=["ddp"]).strategy("ddp").memory
    assert mem.total == pytest.approx(sim["total"], rel=0.10)


def _reduced_8b_numels() -> list[int]:
    h, v, f, kv = 4096, 128256, 14336, 1024
    layer = [h * h, kv * h, kv * h, h * h, f * h, f * h, h * f, h, h]
    return [v * h, v * h, h] + 2 * layer


# Tied embeddings (issue 18 item 3). The trace summed the embedding's and the head's gradient of
# the one shared weight out of place (FakeTensor is a tensor subclass), a real run in place.
V_TIED, H_TIED, T_TIED = 4096, 64, 16


def _tied_loss(weight, ids, chunked: bool):
    import torch.nn.functional as F

    from shardtune.train.core.chunked_loss import chunked_cross_entropy

    hidden = F.embedding(ids, weight)  # (T, h)
    if chunked:  # the trainer's head for a vocabulary above 32k
        return chunked_cross_entropy(hidden, weight, ids, 2)
    return F.cross_entropy(F.linear(hidden, weight), ids, reduction="sum")  # one chunk: nn.Linear's head


def _find_node(loss, pred):
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        if pred(node):
            return node
        seen.add(node)
        todo += [n for n, _ in node.next_functions]
    raise AssertionError("node not found")


@pytest.mark.parametrize("chunked,in_place", [(True, True), (False, False)])
def test_real_autograd_sums_tied_grads_in_place_unless_the_heads_is_a_view(chunked, in_place):
    # plain tensors, no tracker: the buffer AccumulateGrad receives is the head's own gradient
    # (summed in place) for the chunked loss's dW, a new tensor when the head hands a view
    import torch

    weight = torch.randn(V_TIED, H_TIED, requires_grad=True)
    loss = _tied_loss(weight, torch.randint(0, V_TIED, (T_TIED,)), chunked)
    acc = _find_node(loss, lambda n: getattr(n, "variable", None) is weight)
    emb = _find_node(loss, lambda n: type(n).__name__ == "EmbeddingBackward0")
    head = _find_node(loss, lambda n: n is not emb and any(m is acc for m, _ in n.next_functions))
    ptrs = {}

    def head_grad(grad_inputs, _grad_outputs) -> None:
        ptrs["head"] = next(g for g in grad_inputs if g is not None and g.shape == weight.shape).data_ptr()

    def summed(grad_outputs) -> None:
        ptrs["sum"] = grad_outputs[0].data_ptr()

    head.register_hook(head_grad)
    acc.register_prehook(summed)
    loss.backward()
    assert (ptrs["sum"] == ptrs["head"]) is in_place


@pytest.mark.parametrize("chunked", [True, False])
def test_trace_sums_tied_grads_where_autograd_does(chunked):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardtune.verify.simulate import TiedGradSumInPlace

    def peak(mode: bool) -> int:
        with FakeTensorMode():
            weight = torch.nn.Parameter(torch.randn(V_TIED, H_TIED))
            ids = torch.randint(0, V_TIED, (T_TIED,))
            tracker = MemTracker()
            tracker.track_external(weight)
            with TiedGradSumInPlace() if mode else contextlib.nullcontext(), tracker:
                _tied_loss(weight, ids, chunked).backward()
        return sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())

    # the out-of-place sum is one more (V, h) fp32 tensor; where autograd sums in place the trace
    # must not make it (the in-place trace peaks a moment earlier, beside one (T, h) fp32 grad)
    if chunked:
        assert 0 <= 4 * V_TIED * H_TIED - (peak(False) - peak(True)) <= 4 * T_TIED * H_TIED
    else:
        assert peak(False) == peak(True)


def _tied_config(name: str) -> dict:
    """Two layers of Llama-3.2-1B's and Qwen2.5-0.5B's widths (HF config.json values), tied."""
    from shardtune.catalog.models import _llama

    if name == "llama-3.2-1b":
        return _llama(2048, 8192, 2, 32, 8, 128256, 131072, 500000.0, tie_word_embeddings=True, head_dim=64)
    cfg = _llama(896, 4864, 2, 14, 2, 151936, 32768, 1000000.0, tie_word_embeddings=True,
                 architectures=["Qwen2ForCausalLM"], model_type="qwen2", rms_norm_eps=1e-6)
    del cfg["attention_bias"], cfg["mlp_bias"]
    return cfg


@pytest.mark.timeout(180)
@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen2.5-0.5b"])
@pytest.mark.parametrize("strategy", ["zero3", "ddp", "zero1"])
def test_tied_model_analytic_within_tolerance_of_simulated(model, strategy):
    from shardtune.plan import plan
    from shardtune.verify.simulate import simulate_strategy

    cfg = _tied_config(model)
    sim = simulate_strategy(PlanInputs(cfg, N, seq_len=512), strategy)
    mem = plan(cfg, gpus=N, seq_len=512, strategies=[strategy]).strategy(strategy).memory
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    # by hand: the trace's peak holds the embedding's and the head's grad of the one (V, h) weight
    # (FSDP2: bf16; ddp/zero1: fp32), and never a third, their sum (autograd sums in place)
    grads_at_peak = sim["breakdown_at_peak"].get("Temp", 0)
    assert grads_at_peak >= 2 * (2 if strategy == "zero3" else 4) * v * h
    assert grads_at_peak < 3 * (2 if strategy == "zero3" else 4) * v * h
    assert_plan_within_trace(mem, sim)


@pytest.mark.timeout(120)
def test_pure_bf16_traces_every_strategy(capsys):
    # ddp/zero1 under pure bf16 fell back ("Couldn't swap Embedding.weight"): the cast made fake
    # parameters that to_empty had to swap. By hand, tiny-llama (V 264, h 128, FFN 344, KV dim 64,
    # 4 layers, untied): 4 · (2·128² + 2·64·128 + 3·344·128 + 2·128) + 2·264·128 + 128 = 793,728
    # parameters, 2 bytes each: whole under ddp/zero1, halved under the FSDP strategies at N = 2
    rc = main(["plan", "tiny-llama", "--gpus", "2", "--seq-len", "64", "--precision", "bf16",
               "--optimizer-impl", "bf16-stochastic", "--simulate", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and "cannot trace" not in err, err
    numel = 4 * (2 * 128**2 + 2 * 64 * 128 + 3 * 344 * 128 + 2 * 128) + 2 * 264 * 128 + 128
    for s in json.loads(out)["strategies"]:
        assert s["simulated"]["status"] == "traced", s["name"]
        assert s["simulated"]["params"] == 2 * numel // (1 if s["name"] in ("ddp", "zero1") else 2), s["name"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_peak_stats_without_the_module_walk_give_the_same_bytes(strategy, monkeypatch):
    # The tracker keeps only the overall peak after each op (train/core/memtrack.py); torch's own
    # _update_peak_stats also walks every tracked module (ops x modules: 80 % of a simulate). The
    # reference is the same trace with torch's method put back: every figure equal to the byte.
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardtune.verify.simulate import simulate_strategy

    cfg = _reduced_8b()
    cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=1024, num_hidden_layers=3)
    calls = {"walks": 0}
    stock = MemTracker._update_peak_stats

    def counting(self, peak_state):
        calls["walks"] += 1
        return stock(self, peak_state)

    monkeypatch.setattr(MemTracker, "_update_peak_stats", counting)
    fast = simulate_strategy(PlanInputs(cfg, 4, seq_len=128), strategy)
    assert calls["walks"] == 0  # the subclass no longer calls the module walk

    from shardtune.train.core import memtrack

    real_make = memtrack._make_tracker

    def with_stock(fsdp, model, optimizer):
        tracker = real_make(fsdp, model, optimizer)
        record = tracker._record_maxima

        def stock_then_record(peak_state):
            counting(tracker, peak_state)
            if not tracker._defer_maxima:
                record()
        tracker._update_peak_stats = stock_then_record
        return tracker

    monkeypatch.setattr(memtrack, "_make_tracker", with_stock)
    reference = simulate_strategy(PlanInputs(cfg, 4, seq_len=128), strategy)
    assert calls["walks"] > 100  # torch's walk really ran in the reference trace
    drop = {"wall_s"}
    assert {k: v for k, v in fast.items() if k not in drop} == {k: v for k, v in reference.items() if k not in drop}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp,sp", [(2, True), (8, True), (2, False)])
def test_tensor_parallel_analytic_within_tolerance_of_simulated(tp, sp):
    # The trainer's 2-D step (parallel/tp.py apply_tp, then FSDP2 over dp_shard of the one mesh)
    # traced on fake tensors at world 8, against the analytic TP plan: the tolerances.
    from shardtune.plan import plan
    from shardtune.verify.simulate import simulate_strategy

    cfg = _reduced_8b()
    sim = simulate_strategy(PlanInputs(cfg, N, seq_len=512, tp=tp, sequence_parallel=sp), "zero3")
    mem = plan(cfg, gpus=N, seq_len=512, tp=tp, sequence_parallel=sp, strategies=["zero3"]).strategy("zero3").memory
    assert_plan_within_trace(mem, sim)


def test_cli_simulate_traces_a_tensor_parallel_plan(capsys):
    assert main(["plan", "tiny-llama", "--gpus", "4", "--gpus-per-node", "4", "--tp", "2", "--strategy", "zero3",
                 "--seq-len", "256", "--simulate", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["strategies"][0]
    assert s["layout"]["tp"] == 2 and s["simulated"]["status"] == "traced", s["simulated"]
    assert s["simulated"]["params"] == s["memory"]["params"]
