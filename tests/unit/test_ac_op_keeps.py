"""op AC (torch's selective checkpoint: matmul and SDPA outputs kept): what it keeps tensor by
tensor, that its recompute is exact and re-runs no matmul, the planner against `plan --simulate`,
and the `layer` mode's old name `selective` everywhere. Derivation: docs/ac.md."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shardtune.catalog.models import MODELS, resolve_model_config  # noqa: E402
from shardtune.parallel.ac import _OP_SAVED, apply_activation_checkpointing  # noqa: E402
from shardtune.plan.activations import op_kept_layer_bytes  # noqa: E402
from shardtune.plan.params import architecture_from_config  # noqa: E402
from shardtune.plan.validate import PlanInputs  # noqa: E402


def _tiny(dtype=torch.float32, mode="none"):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = resolve_model_config("tiny-llama")
    hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf).to(dtype).train()
    apply_activation_checkpointing(model, mode, 2)
    return cfg, model


def _batch(b=2, s=48):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (b, s), generator=g)
    pos = torch.cat([torch.arange(20), torch.arange(s - 20)]).repeat(b, 1)  # packed rows: block mask
    return ids, pos


def _layer_storages(model, ids, pos):
    """Every op's output storage first made inside decoder layer 1's forward (a dispatch mode
    outside the model, so also outside SAC's own) and still alive after the forward: {data_ptr:
    (bytes, made by an op of op AC's save list)}. Parameters, the layer's input (and RoPE's
    cos/sin: alive before the layer) and its output (the next layer's input) excluded."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    inside, made, before, out_ptr, alive_before = [False], [], [], [], set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if inside[0]:
                        made.append((StorageWeakRef(st), st.data_ptr(), st.nbytes(), func in _OP_SAVED))
                    else:
                        before.append((StorageWeakRef(st), st.data_ptr()))
            return out

    def pre(*_):
        alive_before.update(p for r, p in before if not r.expired())
        inside[0] = True

    def post(_m, _a, out):
        inside[0] = False
        out_ptr.append((out[0] if isinstance(out, tuple) else out).untyped_storage().data_ptr())

    layer = model.model.layers[1]
    layer.register_forward_pre_hook(pre, prepend=True)
    layer.register_forward_hook(post)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with Record():
        loss = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
    skip |= alive_before | set(out_ptr)
    alive = {}
    for ref, ptr, nbytes, kept_op in made:  # a storage is first made by one op; views keep its ptr
        if not ref.expired() and ptr not in skip and ptr not in alive:
            alive[ptr] = (nbytes, kept_op)
    return loss, alive


@pytest.mark.parametrize("dtype,e", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_op_keeps_exactly_the_matmul_and_sdpa_outputs(dtype, e):
    # Independent measurement: what layer 1 still holds after the forward, storage by storage.
    cfg, model = _tiny(dtype, "op")
    ids, pos = _batch()
    _, alive = _layer_storages(model, ids, pos)
    kept, shared = op_kept_layer_bytes(architecture_from_config(cfg), ids.numel(), e)
    assert all(k for _, k in alive.values())  # nothing but the save list's outputs
    assert sum(n for n, _ in alive.values()) == kept
    # Without AC the layer keeps more (norms, RoPE'd q/k, repeated k/v, the mask, SiLU, ...),
    # and of the save list's outputs exactly the `shared` part (SDPA out and lse, gate, up):
    # what the recomputed layer in backward need not rebuild (plan/activations.py, docs/ac.md)
    _, model = _tiny(dtype, "none")
    _, alive = _layer_storages(model, ids, pos)
    assert sum(n for n, _ in alive.values()) > 1.5 * kept
    assert sum(n for n, k in alive.values() if k) == shared


def test_op_recompute_is_exact_and_reruns_no_matmul():
    from torch.utils.flop_counter import FlopCounterMode

    ids, pos = _batch()
    grads, flops, losses = {}, {}, {}
    for mode in ("none", "op", "full"):
        _, model = _tiny(torch.float32, mode)
        with FlopCounterMode(display=False) as fc:
            loss = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
            loss.backward()
        flops[mode], losses[mode] = fc.get_total_flops(), loss.item()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert losses["op"] == losses["none"]
    for n, g in grads["none"].items():
        torch.testing.assert_close(grads["op"][n], g, rtol=0, atol=1e-6)
    assert flops["op"] == flops["none"]  # matmuls and SDPA are kept, never re-run
    assert flops["full"] > flops["none"]  # while full AC re-runs them (the counter sees recompute)


@pytest.mark.timeout(120)
def test_op_planner_within_10_percent_of_simulated_reduced_llama3_8b():
    from shardtune.plan import plan
    from shardtune.verify.simulate import simulate_strategy

    cfg = dict(MODELS["llama-3-8b"]["config"])
    cfg["num_hidden_layers"] = 2
    sim = simulate_strategy(PlanInputs(cfg, 8, seq_len=512, ac="op"), "zero3")
    mem = plan(cfg, gpus=8, seq_len=512, ac="op", strategies=["zero3"]).strategy("zero3").memory
    for key in ("activations", "total"):
        assert getattr(mem, key) == pytest.approx(sim[key], rel=0.10), (key, getattr(mem, key), sim[key])
    none = plan(cfg, gpus=8, seq_len=512, ac="none", strategies=["zero3"]).strategy("zero3").memory
    full = plan(cfg, gpus=8, seq_len=512, ac="full", strategies=["zero3"]).strategy("zero3").memory
    assert full.activations < mem.activations < none.activations


def test_layer_ac_keeps_selective_as_its_old_name(capsys):
    import json

    from shardtune.cli import main
    from shardtune.config import load_recipe
    from shardtune.plan import plan
    from shardtune.rules.combination import check_combination

    got = {}
    for ac in ("selective", "layer", "op", "none", "full"):
        assert main(["plan", "tiny-llama", "--gpus", "2", "--seq-len", "64", "--ac", ac, "--json"]) == 0
        got[ac] = json.loads(capsys.readouterr().out)
    assert got["selective"]["inputs"]["ac"] == "layer" and got["op"]["inputs"]["ac"] == "op"
    assert got["selective"]["strategies"] == got["layer"]["strategies"]
    act = {ac: next(s for s in got[ac]["strategies"] if s["name"] == "zero3")["memory"]["activations"]
           for ac in got}
    assert act["full"] < act["op"] < act["none"]
    assert plan("tiny-llama", 2, ac="selective").strategy("zero3").memory.activations == \
        plan("tiny-llama", 2, ac="layer").strategy("zero3").memory.activations
    assert load_recipe(None, ["parallel.activation_checkpointing=op"]).parallel.activation_checkpointing == "op"
    for ac in ("op", "layer", "selective"):
        check_combination("zero3", activation_checkpointing=ac)
    assert main(["plan", "tiny-llama", "--gpus", "2", "--ac", "opp"]) == 2
    assert "did you mean 'op'" in capsys.readouterr().err


def test_planner_prices_op_between_none_and_full():
    # op re-runs no matmul but its element-wise recompute costs time (bench/recompute.py measured
    # +5.8 % on the CPU, docs/ac.md): the planner's compute time lies strictly between none's and
    # full's, and nearer none's
    from shardtune.plan import plan

    t = {ac: plan("llama-3-8b", 8, seq_len=4096, ac=ac, strategies=["zero3"]).strategy("zero3")
         .timing["compute_time_s"] for ac in ("none", "op", "full")}
    assert t["none"] < t["op"] < t["full"]
    assert t["op"] - t["none"] < (t["full"] - t["none"]) / 2
