"""Memory and communication of each strategy against the ZeRO paper and hand derivations."""
import pytest

from shardtune.plan import plan
from shardtune.plan.activations import activation_bytes, korthikanti_layer_bytes
from shardtune.plan.memory import fsdp2_shard_numel, zero1_partition
from shardtune.plan.params import Architecture

GIB = 2**30


def test_zero_paper_figure1():
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5 B, N_d = 64, K = 12 →
    # baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB (10^9 bytes).
    r = plan(params=7.5e9, gpus=64, accounting="paper")
    got = {s.name: round(s.memory.total / 1e9, 1) for s in r.strategies}
    assert (got["ddp"], got["zero1"], got["zero2"], got["zero3"]) == (120.0, 31.4, 16.6, 1.9)


def test_paper_comm_zero3_is_one_and_a_half_ddp():
    # ZeRO §7: DP and ZeRO-1/2 move 2Ψ elements, ZeRO-3 3Ψ (two all-gathers + reduce-scatter).
    r = plan(params=1e9, gpus=16, accounting="paper")
    assert r.strategy("zero3").comm_ratio_to_ddp == 1.5
    assert r.strategy("zero2").comm_ratio_to_ddp == 1.0
    # ring: all-reduce sends 2(N−1)/N·S per rank, S = 2 bytes × Ψ
    assert r.strategy("ddp").comm_bytes_per_step == round(2 * 15 / 16 * 2e9)


def test_shardtune_comm_in_bytes():
    # bf16-mixed: DDP all-reduces fp32 grads (4Ψ); zero3 gathers bf16 twice (2Ψ + 2Ψ) and
    # reduce-scatters fp32 (4Ψ): (N−1)/N·8Ψ either way, a ratio of 1.0 in bytes.
    n, psi = 4, 1_000_000_000
    r = plan(params=psi, gpus=n)
    assert r.strategy("ddp").comm_bytes_per_step == round(2 * (n - 1) / n * 4 * psi)
    assert r.strategy("zero3").comm_bytes_per_step == round((n - 1) / n * (2 + 2 + 4) * psi)
    assert r.strategy("zero1").comm_ratio_to_ddp == 1.5  # + fp32 param broadcast (N−1)/N·4Ψ
    fp32 = plan(params=psi, gpus=n, precision="fp32")
    assert fp32.strategy("zero3").comm_ratio_to_ddp == 1.5  # every element 4 bytes: 3Ψ vs 2Ψ


# tiny-llama: V=264, h=128, I=344, 4 layers, 4 heads, 2 KV heads of 32, untied.
def _tiny_shards_by_hand(n_rows):
    """Padded per-rank elements for tiny-llama: each tensor keeps ceil(dim0/N) rows."""
    embed = n_rows(264) * 128
    layer = (n_rows(128) * 128 + 2 * n_rows(64) * 128 + n_rows(128) * 128  # q, k, v, o
             + 2 * n_rows(344) * 128 + n_rows(128) * 344  # gate, up, down
             + 2 * n_rows(128))  # two RMSNorm weights
    return embed + 4 * layer + n_rows(128) + n_rows(264) * 128  # + final norm + lm_head


def test_zero3_fp32_exact_shards_with_padding():
    # N = 3 pads: 128 → 43 rows (129), 64 → 22 (66), 344 → 115 (345); 264 → 88 (exact).
    local = _tiny_shards_by_hand(lambda d: -(-d // 3))
    assert local == 88 * 128 + 4 * (43 * 128 + 44 * 128 + 43 * 128 + 230 * 128 + 43 * 344 + 86) + 43 + 88 * 128
    s = plan("tiny-llama", 3, precision="fp32", seq_len=16, optimizer_impl="foreach").strategy("zero3")
    assert (s.memory.params, s.memory.grads, s.memory.optimizer) == (4 * local, 4 * local, 8 * local)
    assert s.memory.optimizer_step_temp == 4 * local  # foreach AdamW's sqrt(v) copy
    auto = plan("tiny-llama", 3, precision="fp32", seq_len=16).strategy("zero3")  # auto: fused, no temporary
    # fused keeps each tensor's fp32 `step` counter beside the params: 4 B × 39 tensors
    assert auto.memory.optimizer_step_temp == 0 and auto.memory.optimizer == 8 * local + 4 * 39


def test_fsdp2_per_rank_local_bytes_by_hand():
    # rank 2 of 3 holds the remainders: 264 → 88 rows, 128 → 42, 64 → 20, 344 → 114
    rank2 = 88 * 128 + 4 * (42 * 128 + 2 * 20 * 128 + 42 * 128 + 2 * 114 * 128 + 42 * 344 + 2 * 42) + 42 + 88 * 128
    s = plan("tiny-llama", 3, precision="fp32", seq_len=16, optimizer_impl="foreach").strategy("zero3")
    per_rank = s.state_bytes_per_rank
    assert per_rank["params"][2] == 4 * rank2 and per_rank["optimizer"][2] == 8 * rank2
    assert per_rank["params"][0] == s.memory.params  # rank 0 = the padded allocation


def test_fsdp2_rows_match_torch_chunk():
    import torch

    for dim0, n in [(264, 3), (64, 5), (8, 16), (344, 8)]:
        chunks = torch.empty(dim0).chunk(n)
        for r in range(n):
            real = chunks[r].numel() if r < len(chunks) else 0
            assert fsdp2_shard_numel((dim0,), n, r, padded=False) == real
        assert fsdp2_shard_numel((dim0,), n) == chunks[0].numel()  # rank 0 = padded size


def test_zero1_partition_greedy_by_hand():
    # largest first to the emptiest rank: 10→r0, 7→r1, 5→r1, 3→r0, 3→r1
    assert zero1_partition([3, 10, 5, 7, 3], 2) == [[10, 3], [7, 5, 3]]


def test_ddp_and_zero1_bf16_mixed_by_hand():
    psi = 264 * 128 * 2 + 4 * (2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 344 + 2 * 128) + 128
    matrices_but_embedding = 264 * 128 + 4 * (2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 344)
    r = plan("tiny-llama", 2, seq_len=16)  # auto: fused AdamW, a 4 B step counter per tensor (39) on device
    ddp = r.strategy("ddp").memory
    assert (ddp.params, ddp.grads, ddp.optimizer) == (4 * psi, 4 * psi, 8 * psi + 4 * 39)
    assert ddp.buffers == 2 * matrices_but_embedding  # autocast's bf16 weight cache
    z1 = r.strategy("zero1").memory
    assert (z1.params, z1.grads) == (4 * psi, 4 * psi)
    assert psi / 2 <= z1.optimizer / 8 <= psi / 2 + 128 * 344  # greedy split within one tensor


def test_pure_bf16_and_fp32_bytes_per_param():
    bf16 = plan(params=1e9, gpus=1, precision="bf16").strategy("ddp").memory
    assert (bf16.params, bf16.grads, bf16.optimizer) == (2e9, 2e9, 4e9)  # no fp32 master
    fp32 = plan(params=1e9, gpus=1, precision="fp32").strategy("ddp").memory
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4e9, 4e9, 8e9)


def test_lora_frozen_weights_carry_no_grads_or_states():
    r = plan("tiny-llama", 1, precision="fp32", lora_rank=8, seq_len=16)
    # adapters on q,k,v,o,gate,up,down: r·(in + out) each, 4 layers
    adapters = 4 * 8 * ((128 + 128) + 2 * (128 + 64) + (128 + 128) + 2 * (128 + 344) + (344 + 128))
    assert r.model["trainable_params"] == adapters
    ddp = r.strategy("ddp").memory  # + fused AdamW's on-device step counters, 4 B × 56 adapter tensors
    assert (ddp.grads, ddp.optimizer) == (4 * adapters, 8 * adapters + 4 * 56)
    assert ddp.params == 4 * r.model["params"]
    # bf16-mixed: the frozen base is stored in bf16 (2 B), the adapters keep fp32 masters (4 B)
    mixed = plan("tiny-llama", 1, precision="bf16-mixed", lora_rank=8, seq_len=16).strategy("ddp").memory
    base = r.model["params"] - adapters
    assert mixed.params == 2 * base + 4 * adapters
    assert (mixed.grads, mixed.optimizer) == (4 * adapters, 8 * adapters + 4 * 56)


def test_hsdp_shards_over_the_group_and_offload_reports_cpu_ram():
    r = plan(params=16e9, gpus=16, gpus_per_node=8, precision="fp32")
    hsdp, z3 = r.strategy("hsdp").memory, r.strategy("zero3").memory
    assert hsdp.params == 4 * 16e9 / 8 and z3.params == 4 * 16e9 / 16
    off = plan(params=16e9, gpus=16, gpus_per_node=8, precision="fp32", offload="all").strategy("zero3")
    assert off.memory.params == off.memory.grads == off.memory.optimizer == 0
    per_rank = (4 + 4 + 8) * 16e9 / 16  # params, grads, Adam m and v; auto = fused: no step temporary
    assert off.cpu_offload_bytes_per_node == 8 * per_rank
    assert [s.name for s in plan(params=1e9, gpus=8, offload="all").strategies] == ["zero2", "zero3", "hsdp"]


def test_fits_against_capacity_minus_reserve():
    # h100-80gb reports 81,559 MiB; the default reserve is 1 GiB + 5 % of it.
    r = plan(params=1e9, gpus=8, gpu="h100-80gb")
    usable = 81_559 * 2**20 - (GIB + 81_559 * 2**20 // 20)
    assert r.hardware["usable_bytes"] == usable
    z3 = r.strategy("zero3")
    assert z3.headroom_bytes == usable - z3.memory.total and z3.fits
    tight = plan(params=1e9, gpus=8, reserve_gib=79.5)
    assert not tight.strategy("zero3").fits and "zero3" in tight.verdict


def test_korthikanti_eq1_gpt3():
    # Eq. (1) for GPT-3 175B (s=2048, h=12288, a=96, b=1): sbh(34 + 5as/h) = sbh·(34 + 80).
    assert korthikanti_layer_bytes(2048, 1, 12288, 96) == 2048 * 12288 * 114


TINY = Architecture(model_type="llama", hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=4, vocab_size=10, tie_embeddings=False)


def test_activations_worked_example():
    # b=1, s=4 → T=4 tokens, bf16 (2 bytes). Per layer, tensor by tensor:
    T = 4
    norms = 2 * (T * 8 * 4 + T * 4 + T * 8 * 2)  # fp32 input copy, fp32 rsqrt, bf16 normalised; ×2
    qkv_in = T * 8 * 2
    sdpa = T * 8 * 2 + 2 * T * 4 * 2 + T * 8 * 2 + T * 2 * 4  # q, k, v (GQA: 4 wide), out, fp32 lse/head
    mlp_in = T * 8 * 2
    swiglu = 4 * T * 16 * 2  # gate out, silu out, up out, product
    layer = norms + qkv_in + sdpa + mlp_in + swiglu
    assert layer == 1280
    head = T * 8 * 4 + T * 4 + T * 8 * 2 + T * 8 * 2 + T * 10 * (2 + 4 + 4)  # norm, lm_head in, logits/loss
    rope = 2 * T * 4 * 2  # cos and sin, once per model
    assert activation_bytes(TINY, 1, 4) == 2 * layer + head + rope
    # full AC: each layer keeps its bf16 input; one layer is recomputed in backward
    assert activation_bytes(TINY, 1, 4, ac="full") == 2 * (T * 8 * 2) + layer + head + rope
    # selective every 2nd layer: layer 0 checkpointed, layer 1 kept, + the recompute
    assert activation_bytes(TINY, 1, 4, ac="selective", ac_every=2) == T * 8 * 2 + layer + layer + head + rope


def test_activation_scales_with_micro_batch_and_seq():
    one = activation_bytes(TINY, 1, 4)
    assert activation_bytes(TINY, 3, 4) == 3 * one
    assert activation_bytes(TINY, 1, 12) == 3 * one  # no s² term: SDPA keeps no s×s matrix


def test_llama3_70b_zero3_does_not_fit_8x80gb():
    # 16 B/param × 70.55e9 / 8 ≈ 141 GB of model states per GPU before any activation.
    z3 = plan("llama-3-70b", 8, gpu="h100-80gb").strategy("zero3")
    states = z3.memory.params + z3.memory.grads + z3.memory.optimizer
    assert states == pytest.approx(16 * 70_553_706_496 / 8, rel=1e-6)
    assert not z3.fits


def test_fsdp_buffers_by_hand():
    # The trainer's contract (docs/DESIGN.md): zero3 holds the bf16 root group (embedding, final
    # norm, LM head) and two bf16 layers unsharded, one layer's bf16 grads plus FSDP2's fp32
    # reduce-scatter input, and the root's bf16 grads (LM head, final norm) until the end.
    layer = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 344 + 2 * 128
    lm_head_and_norm = 264 * 128 + 128
    root = 264 * 128 + lm_head_and_norm
    psi = root + 4 * layer
    r = plan("tiny-llama", 2, seq_len=16)
    grads_in_flight = 2 * lm_head_and_norm + (2 + 4) * layer
    assert r.strategy("zero3").memory.buffers == 2 * (root + 2 * layer) + grads_in_flight
    # zero2 keeps every bf16 unsharded param from forward to backward
    assert r.strategy("zero2").memory.buffers == 2 * psi + grads_in_flight
    z3 = r.strategy("zero3").memory
    # zero_grad(set_to_none=True) frees FSDP's sharded grads at the step's start: they are not
    # there at the activation peak; the optimizer step sees the states and its own temporaries
    # only (train_step drops the last logits before backward; calibrated against `plan
    # --simulate`, docs/calibration.md) ... and the end of backward holds the root's bf16 grads and
    # their fp32 reduce-scatter input
    # while the root's own fp32 sharded grads (ceil(264/2) rows of the embedding and the LM head,
    # half the norm: rank 0 of 2) do not exist yet: the reduce-scatter makes them
    root_reduce = (2 + 4) * root - 4 * (2 * 132 * 128 + 64)
    assert z3.total == max(z3.params + z3.optimizer + max(z3.activations + z3.buffers,
                                                          z3.grads + z3.optimizer_step_temp),
                           z3.params + z3.grads + z3.optimizer + root_reduce)


@pytest.mark.parametrize("dtype_name,elem_bytes", [("float32", 4), ("bfloat16", 2)])
def test_layer_activations_match_torch_saved_tensors(dtype_name, elem_bytes):
    # Independent measurement: every tensor autograd saves during one decoder layer's forward
    # (torch.autograd.graph.saved_tensors_hooks), parameters excluded, each storage counted once,
    # storages shared with earlier layers (RoPE cos/sin, computed once per model) excluded.
    import torch
    from _saved import saved_in
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardtune.catalog.models import resolve_model_config
    from shardtune.plan.activations import layer_activation_bytes
    from shardtune.plan.params import architecture_from_config

    cfg = resolve_model_config("tiny-llama")
    hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf).to(getattr(torch, dtype_name)).train()
    b, s = 2, 48
    ids = torch.randint(0, 256, (b, s))
    with saved_in(model, model.model.layers[1]) as saved:
        model(input_ids=ids, labels=ids, use_cache=False)
    arch = architecture_from_config(cfg)
    assert sum(saved.values()) == layer_activation_bytes(arch, b * s, elem_bytes)


def test_adamw_step_counters_are_host_bytes_per_owned_tensor():
    # torch's own AdamW as the trainer builds it (not fused, not capturable): one 0-dim fp32
    # `step` tensor on the CPU per parameter tensor, whatever the parameters' device.
    import torch

    from shardtune.catalog.models import resolve_model_config
    from shardtune.plan.memory import shardtune_states
    from shardtune.plan.params import architecture_from_config, model_shapes

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(net.parameters())
    net(torch.ones(1, 4)).sum().backward()
    opt.step()
    steps = [s["step"] for s in opt.state.values()]
    assert len(steps) == 4
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 and t.nbytes == 4 for t in steps)
    # tiny-llama, 4 layers: embed, final norm, lm_head + 9 tensors per layer = 39 tensors
    shapes = model_shapes(architecture_from_config(resolve_model_config("tiny-llama")))
    tensors = 3 + 9 * 4
    ddp = shardtune_states(shapes, "ddp", 2, 1, "fp32", "adamw")
    assert ddp.optimizer_host == 4 * tensors
    assert ddp.optimizer == 8 * sum(p.numel for p in shapes)  # the GPU's m and v: no counters
    for rank in range(4):  # FSDP2: every rank holds a shard of every tensor
        assert shardtune_states(shapes, "zero3", 4, 4, "fp32", "adamw", rank).optimizer_host == 4 * tensors
    z1 = [shardtune_states(shapes, "zero1", 2, 2, "fp32", "adamw", r).optimizer_host for r in (0, 1)]
    assert sum(z1) == 4 * tensors and all(0 < h < 4 * tensors for h in z1)  # whole tensors split
    assert shardtune_states(shapes, "zero3", 4, 4, "fp32", "sgd").optimizer_host == 0


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_fsdp_end_of_backward_peak_by_hand(grad_accum):
    # Llama-3-8B widths with 2 layers and full AC: the peak is the end of backward (checked
    # against the trace in tests/unit/test_simulate.py). The root group (embedding, LM head,
    # final norm) has its bf16 unsharded grads and its fp32 reduce-scatter input alive together;
    # its own fp32 grad shard is not there yet unless an earlier micro-batch made it.
    from shardtune.catalog.models import MODELS

    cfg = dict(MODELS["llama-3-8b"]["config"], num_hidden_layers=2)
    v, h, n = 128256, 4096, 8
    root = 2 * v * h + h
    root_shard = 2 * -(-v // n) * h + h // n
    m = plan(cfg, n, seq_len=512, ac="full", grad_accum=grad_accum, strategies=["zero3"]).strategy("zero3").memory
    states = m.params + m.grads + m.optimizer
    expected = states + (2 + 4) * root - (4 * root_shard if grad_accum == 1 else 0)
    assert m.total == expected


@pytest.mark.parametrize("impl", ["foreach", "fused", "for-loop", "bf16-stochastic"])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_adamw_step_temporaries_match_torchs_memtracker(impl, dtype_name):
    """The planner's AdamW-step temporaries for each kernel against PyTorch's own measurement:
    MemTracker's peak during `step()` minus what is live after it (real tensors, a second step,
    so the states exist before it starts)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardtune.config import OptimConfig, ParallelConfig
    from shardtune.plan.memory import optimizer_temp_bytes
    from shardtune.train.core.optim import build_optimizer

    dtype = getattr(torch, dtype_name)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 128, bias=False),
                                torch.nn.Linear(128, 64, bias=False)).to(dtype)
    opt = build_optimizer(model, OptimConfig(implementation=impl, weight_decay=0.1), ParallelConfig(strategy="ddp"))
    for step in range(2):
        model(torch.randn(4, 256, dtype=dtype)).sum().backward()
        if step == 0:
            opt.step()
            continue
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            opt.step()
        device = next(iter(tracker.get_tracker_snapshot("peak")))
        measured = (tracker.get_tracker_snapshot("peak")[device]["Total"]
                    - tracker.get_tracker_snapshot("current")[device]["Total"])
    numels = [256 * 256, 256 * 128, 128 * 64]
    elem = 4 if dtype == torch.float32 else 2
    assert optimizer_temp_bytes(sum(numels), max(numels), "adamw", elem, impl) == measured
