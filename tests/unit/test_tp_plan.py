"""The planner with tensor (and sequence) parallelism, against the papers, torch and the CLI.

References: Korthikanti et al. 2022 Table 2 (per-layer activation bytes with t), the ZeRO paper's
Table 2 (largest model per model-parallel degree), the tensors torch saves under its own DTensor
TP (`parallelize_module`, not our trainer), and `shardtune plan --tp` as a user runs it."""
import json

import pytest

from shardtune.cli import main
from shardtune.plan import plan
from shardtune.plan.activations import korthikanti_layer_bytes
from shardtune.plan.tp import tp_dim

GIB = 2**30


def test_korthikanti_table2_22b_t8():
    # Korthikanti et al. 2022, Table 2 (per-layer activation bytes) at their 22B model (Table 3:
    # a = 64 heads, h = 6144, s = 2048) with t = 8, b = 1, worked by hand:
    # TP:      sbh(10 + 24/t + 5as/(ht)) = sbh(10 + 3 + 655360/49152) = sbh(13 + 40/3)
    # TP + SP: sbh(34/t + 5as/(ht))      = sbh(4.25 + 40/3)
    sbh = 2048 * 6144
    assert korthikanti_layer_bytes(2048, 1, 6144, 64, tp=8) == pytest.approx(sbh * (13 + 40 / 3))
    assert korthikanti_layer_bytes(2048, 1, 6144, 64, tp=8, sp=True) == pytest.approx(sbh * (4.25 + 40 / 3))
    # t = 1 is eq. (1): sbh(34 + 5as/h)
    assert korthikanti_layer_bytes(2048, 1, 6144, 64, tp=1) == pytest.approx(sbh * (34 + 5 * 64 * 2048 / 6144))


@pytest.mark.parametrize("mp", [1, 2, 4, 8, 16])
def test_zero_paper_table2_max_model_size_by_mp(mp):
    # Rajbhandari et al. 2020 Table 2: the largest model whose states fit a 32 GB V100 with
    # DP 64 beside model parallelism MP (64·MP GPUs): baseline, P_os, P_os+g, P_os+g+p
    # = 2B, 7.6B, 14.4B, 128B times MP (16: 32B, 121.6B, 230.4B, 2T). Their MP 16 ran on DGX-2
    # nodes of 16 GPUs.
    table = {"ddp": 2e9, "zero1": 7.6e9, "zero2": 14.4e9, "zero3": 128e9}
    per_node = max(8, mp)
    r = plan(params=1e9, gpus=64 * mp, gpus_per_node=per_node, tp=mp, accounting="paper")
    for name, size in table.items():
        bytes_per_param = r.strategy(name).memory.total / 1e9  # per GPU, for a 1e9-parameter model
        assert 32e9 / bytes_per_param == pytest.approx(size * mp, rel=0.01), name


def _tiny_arch():
    from shardtune.catalog.models import resolve_model_config
    from shardtune.plan.params import architecture_from_config

    return resolve_model_config("tiny-llama"), architecture_from_config(resolve_model_config("tiny-llama"))


@pytest.mark.parametrize("sp", [True, False])
def test_layer_activations_match_torch_dtensor_tp(sp):
    # Independent measurement: torch's own TP plan (parallelize_module: colwise q/k/v/gate/up,
    # rowwise o/down, SequenceParallel norms) on a transformers Llama layer, rank 0 of 2 under the
    # "fake" process group; every tensor autograd saves in layer 1, parameters excluded, each
    # storage once, DTensors counted by their local tensor.
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.plan.activations import layer_activation_bytes

    cfg, arch = _tiny_arch()
    tp = 2
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (tp,))
        hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
        hf._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf).train()
        out = Shard(1) if sp else Replicate()
        for layer in model.model.layers:
            lp = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
            lp.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                       "self_attn.o_proj": RowwiseParallel(output_layouts=out),
                       "mlp.down_proj": RowwiseParallel(output_layouts=out)})
            if sp:
                lp.update({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                           "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                           desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                           "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
            parallelize_module(layer, mesh, lp)
        local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
        params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
        inside, saved, before = [False], {}, set()

        def pack(t):
            ptr = local(t).untyped_storage().data_ptr()
            if inside[0] and ptr not in params and ptr not in before:
                saved[ptr] = local(t).untyped_storage().nbytes()
            elif not inside[0] and not saved:
                before.add(ptr)
            return t

        model.model.layers[1].register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
        model.model.layers[1].register_forward_hook(lambda *a: inside.__setitem__(0, False))
        b, s = 2, 48
        ids = torch.randint(0, 256, (b, s))
        pos = torch.arange(s).expand(b, s)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = model.model.embed_tokens(ids)
            h = h[:, : s // tp] if sp else h  # this rank's sequence shard between the blocks
            pe = model.model.rotary_emb(h, pos)
            for layer in model.model.layers:
                h = layer(h, position_embeddings=pe, attention_mask=None, position_ids=pos)
                h = h[0] if isinstance(h, tuple) else h
    finally:
        dist.destroy_process_group()
    assert sum(saved.values()) == layer_activation_bytes(arch, b * s, 4, tp=tp, sp=sp)


def test_tp_shards_everything_but_the_norms():
    # Summed over all 4 ranks (2 data-parallel × 2 tensor-parallel), each rank's local fp32 master
    # weights are the model once per data-parallel replica... of which there is none (zero3):
    # the whole model once, plus the RMSNorm weights once more per extra TP rank (replicated).
    _, arch = _tiny_arch()
    r = plan("tiny-llama", 4, tp=2, strategies=["zero3"], gpus_per_node=4)
    z3 = r.strategy("zero3")
    assert z3.layout == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "sequence_parallel": True}
    norms = (2 * arch.num_layers + 1) * arch.hidden_size
    total = r.model["params"]
    assert sum(z3.state_bytes_per_rank["params"]) == 4 * (total + norms)  # tp - 1 = 1 extra copy
    assert {tp_dim("model.layers.0.self_attn.o_proj.weight"), tp_dim("model.layers.0.mlp.up_proj.weight"),
            tp_dim("model.norm.weight"), tp_dim("lm_head.weight")} == {1, 0, None}


def test_tp_comm_matches_korthikanti_counts():
    # With SP each layer all-gathers and reduce-scatters the (b·s·h) activation twice forward and
    # twice backward (Korthikanti §4.2.2), e = 2 bytes. Beside the layers (parallel/tp.py): the
    # head's input all-gather (its reduce-scatter back), the embedding's output all-reduce
    # (replicated for HF's mask and rotary tables) and layer 0's slice (all-gather back); the
    # loss 3 all-reduces of 4·T bytes; the 2L + 1 norm weights' grads all-reduced (SP). No AC.
    r = plan("llama-3-8b", 8, tp=8, strategies=["zero3"], seq_len=4096)
    S, L, T = 2 * 4096 * 4096, 32, 4096
    got = {}
    for c in r.strategy("zero3").collectives:
        if c.group == "tp":
            got[c.op, c.phase] = got.get((c.op, c.phase), 0) + c.payload_bytes
    assert got == {("all_gather", "forward"): (2 * L + 1) * S, ("reduce_scatter", "forward"): 2 * L * S,
                   ("all_reduce", "forward"): S + 3 * 4 * T,
                   ("all_gather", "backward"): (2 * L + 1) * S, ("reduce_scatter", "backward"): (2 * L + 1) * S,
                   ("all_reduce", "backward"): (2 * L + 1) * 2 * 4096}  # SP norm weights' partial grads
    # without SP: (2L + 1) all-reduces each way; AR = RS + AG on the wire, so about the same bytes
    r2 = plan("llama-3-8b", 8, tp=8, strategies=["zero3"], seq_len=4096, sequence_parallel=False)
    tp2 = [c for c in r2.strategy("zero3").collectives if c.group == "tp"]
    ar = {ph: sum(c.payload_bytes for c in tp2 if c.op == "all_reduce" and c.phase == ph)
          for ph in ("forward", "backward")}
    assert ar == {"forward": (2 * L + 1) * S + 12 * T, "backward": (2 * L + 1) * S}


def _run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_405b_fits_with_tp8_through_the_cli(capsys):
    # issue 29's done-when: zero3 alone needs 86.3 GiB of 74.7; with tp 8 a layout fits
    rc, out, err = _run(["plan", "llama-3.1-405b", "--gpus", "128", "--ac", "full", "--json"], capsys)
    assert rc == 0 and not any(s["fits"] for s in json.loads(out)["strategies"])
    rc, out, err = _run(["plan", "llama-3.1-405b", "--gpus", "128", "--tp", "8", "--ac", "full"], capsys)
    assert rc == 0, err
    assert "data-parallel 16 × tensor-parallel 8" in out and "fits: zero3" in out
    rc, out, err = _run(["plan", "llama-3.1-405b", "--gpus", "128", "--tp", "8", "--ac", "full", "--json"], capsys)
    d = json.loads(out)
    z3 = next(s for s in d["strategies"] if s["name"] == "zero3")
    assert z3["fits"] and z3["layout"]["tp"] == 8 and d["inputs"]["tp"] == 8
    assert set(z3["memory"]) >= {"params", "grads", "optimizer", "activations", "total"}
    # model states / (tp · dp): 16 bytes a parameter over 128 GPUs (norms replicated: +0.01 %)
    states = sum(z3["memory"][k] for k in ("params", "grads", "optimizer"))
    assert states == pytest.approx(16 * d["model"]["params"] / 128, rel=1e-3)


@pytest.mark.parametrize("argv,msg", [
    (["--gpus", "12", "--gpus-per-node", "12", "--tp", "8"], "does not divide --gpus 12"),
    (["--gpus", "32", "--tp", "16"], "exceeds the 8 GPUs of a node"),
    (["--gpus", "8", "--tp", "8", "--seq-len", "1001"], "not divisible by --tp 8"),
    (["--gpus", "8", "--tp", "8", "--strategy", "ddp"], "does not compose with strategy"),
    (["--gpus", "8", "--tp", "8", "--strategy", "zero1"], "does not compose with strategy"),
])
def test_bad_tp_is_one_line_exit_2(capsys, argv, msg):
    rc, out, err = _run(["plan", "llama-3-8b", *argv], capsys)
    assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_tp_must_divide_heads(capsys):
    rc, out, err = _run(["plan", "tiny-llama", "--gpus", "4", "--tp", "4"], capsys)  # 2 KV heads
    assert rc == 2 and "KV heads (num_key_value_heads 2" in err and len(err.strip().splitlines()) == 1, err


def test_fit_searches_tp_and_its_pick_plans_the_same():
    # 405B at 32k tokens on 128 H100s: with tp 1 even one sequence's full-AC checkpoints and
    # the states do not fit; the search must go to tp > 1 or (issue 30) cp > 1, and `plan` with the
    # pick's flags agrees.
    from shardtune.plan.fit import search

    fit = search("llama-3.1-405b", gpus=128, seq_len=32768, fit_batch=True)  # micro-batch searched too
    assert fit.best is not None and (fit.best.tp in (2, 4, 8) or fit.best.cp > 1)
    assert not any(c.fits for c in fit.ranked + fit.rejected if c.tp == 1 and c.cp == 1)
    b = fit.best
    r = plan("llama-3.1-405b", 128, seq_len=32768, tp=b.tp, strategies=[b.strategy], ac=b.ac, offload=b.offload,
             micro_batch=b.micro_batch, precision=b.precision, optimizer_impl=b.optimizer_impl, cp=b.cp,
             activation_offload=b.activation_offload, grad_accum=b.grad_accum, pp=b.pp, pp_layers=b.pp_layers)
    assert r.strategy(b.strategy).fits
    assert r.strategy(b.strategy).memory.total / GIB == pytest.approx(b.peak_gib)
    assert (f"--tp {b.tp}" if b.tp > 1 else f"--cp {b.cp}") in b.flags()


def test_tp_collectives_match_commdebugmode_counts():
    # Measured on the trainer (BENCHMARKS.md "Tensor + sequence parallelism on CPU", torch's
    # CommDebugMode on the tp group, tests/dist/_comm_count.py): tiny-llama (L 4, h 128), tp 2 ×
    # dp 2 zero3, 4 rows × 32 tokens a rank, fp32, SP, one step: all-gather 18 calls / 1,179,648
    # bytes, reduce-scatter 17 / 1,114,112, all-reduce 14 / 71,836 (of which one is the grad
    # norm's, 156 bytes: clipping, not the model's TP collectives).
    r = plan("tiny-llama", 4, gpus_per_node=4, tp=2, seq_len=32, micro_batch=4, precision="fp32",
             strategies=["zero3"])
    got: dict[str, list[int]] = {}
    for c in r.strategy("zero3").collectives:
        if c.group == "tp":
            calls, size = got.get(c.op, [0, 0])
            got[c.op] = [calls + c.calls, size + c.payload_bytes]
    assert got == {"all_gather": [18, 1_179_648], "reduce_scatter": [17, 1_114_112],
                   "all_reduce": [14 - 1, 71_836 - 156]}


def test_hsdp_suggestions_stay_within_the_data_parallel_ranks():
    # 405B with tp 8 on 128 GPUs, no SP: hsdp's larger shard groups are tried up to dp = 16 (a
    # shard group of 32 data-parallel ranks does not exist), and the plan still answers
    r = plan("llama-3.1-405b", 128, tp=8, sequence_parallel=False, seq_len=4096, micro_batch=2, ac="full")
    assert not r.strategy("hsdp").fits and "--hsdp-shard-size 32" not in r.verdict
