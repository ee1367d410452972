"""FLOPs, recompute and MFU against PyTorch's own FLOP counter on a real Llama, and by hand."""
import pytest

from shardtune.plan.compute import (
    achievable_mfu,
    compute_time_s,
    matmul_params,
    mfu,
    model_flops_per_token,
    optimizer_step_time_s,
    recompute_flops_per_token,
)


@pytest.fixture(scope="module")
def tiny():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from shardtune.catalog.models import resolve_model_config

    cfg = {k: v for k, v in resolve_model_config("tiny-llama").items() if k != "architectures"}
    c = transformers.LlamaConfig(**cfg)
    c._attn_implementation = "eager"  # explicit QKᵀ and AV matmuls, counted over the full T×T
    torch.manual_seed(0)
    return torch, c, transformers.LlamaForCausalLM(c)


def _count(torch, model, x):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
    return fc.get_total_flops()


def _dims(c, model):
    import torch

    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head = c.num_attention_heads
    return linear, c.num_hidden_layers, head, c.hidden_size // head


def test_palm_flops_match_torch_flop_counter(tiny):
    torch, c, model = tiny
    B, T = 2, 64
    x = torch.randint(0, 256, (B, T))
    measured = _count(torch, model, x)
    linear, L, H, Q = _dims(c, model)
    # PaLM app. B with N = the matmul (nn.Linear) parameters; RMSNorm weights and the input
    # embedding do no matmul. FlopCounterMode counts mm/bmm exactly, so equality is exact.
    assert B * T * model_flops_per_token(linear, L, H, Q, T) == measured
    # matmul_params drops exactly the input embedding for an untied model (norms stay: < 0.2 %)
    total = sum(p.numel() for p in model.parameters())
    assert matmul_params(total, c.vocab_size, c.hidden_size, False) - linear == 2 * L * c.hidden_size + c.hidden_size


@pytest.mark.parametrize("ac,every,wrapped", [("full", 1, [0, 1, 2, 3]), ("layer", 2, [0, 2]),
                                              ("layer", 3, [0, 3])])
def test_recompute_flops_match_torch_checkpoint(tiny, ac, every, wrapped):
    torch, c, base = tiny
    import copy

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = copy.deepcopy(base)
    layers = model.model.layers
    for i in wrapped:  # what the trainer does: non-reentrant checkpoint around whole decoder layers
        layers[i] = checkpoint_wrapper(layers[i])
    B, T = 2, 32
    x = torch.randint(0, 256, (B, T))
    extra = _count(torch, model, x) - _count(torch, base, x)
    linear, L, H, Q = _dims(c, base)
    layer_linear = linear - c.vocab_size * c.hidden_size  # minus the LM head
    down_proj = c.intermediate_size * c.hidden_size
    predicted = B * T * recompute_flops_per_token(ac, layer_linear, L, H, Q, T, ac_every=every,
                                                  unrecomputed_params_per_layer=down_proj)
    assert predicted == extra


def test_recompute_by_hand():
    # 2 layers of 100 matmul params, H·Q = 8, T = 10, full AC, nothing skipped:
    # per layer 2·100 + 4·8·10 = 520 → 1040 per token.
    assert recompute_flops_per_token("full", 200, 2, 2, 4, 10) == 1040
    assert recompute_flops_per_token("layer", 200, 2, 2, 4, 10, ac_every=2) == 520
    assert recompute_flops_per_token("none", 200, 2, 2, 4, 10) == 0


def test_mfu_and_times_by_hand():
    # 70e9·6 = 4.2e11 FLOPs/token; 1000 tokens in 1 s on a 989 TFLOP/s GPU → MFU 0.4247.
    assert mfu(4.2e14, 1.0, 989e12) == pytest.approx(4.2e14 / 989e12)
    assert compute_time_s(4e14, 1e15, 0.4) == pytest.approx(1.0)
    # AdamW 28 B/param: 1e9 params on 2e12 B/s → 14 ms
    assert optimizer_step_time_s(1e9, 2e12) == pytest.approx(0.014)
    assert achievable_mfu("h100-80gb")[0] == 0.40 and achievable_mfu("mystery")[0] < 0.40
