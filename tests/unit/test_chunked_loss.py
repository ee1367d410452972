"""Chunked cross-entropy (train/core/chunked_loss.py) against torch's own full computation."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from shardtune.catalog.models import resolve_model_config
from shardtune.rules.loss import default_loss_chunks
from shardtune.train.core.chunked_loss import IGNORE_INDEX, chunked_cross_entropy, lm_token_loss_sum


def _case(n=37, h=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float32)
    weight = torch.randn(v, h, generator=g, dtype=torch.float32) * 0.3
    target = torch.randint(0, v, (n,), generator=g)
    target[[0, 5, 6, n - 1]] = IGNORE_INDEX  # ignored rows, the last chunk's last row among them
    return hidden, weight, target


def _full(hidden, weight, target):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = F.cross_entropy(h @ w.t(), target, ignore_index=IGNORE_INDEX, reduction="sum")
    (loss * 0.37).backward()  # a non-unit upstream gradient, as the step's dp_size / N
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("k", [1, 2, 4, 5, 36, 37, 64])  # 37 rows: 4 and 5 do not divide it; 64 > rows
def test_loss_and_grads_equal_full_cross_entropy(k):
    hidden, weight, target = _case()
    ref_loss, ref_gh, ref_gw = _full(hidden, weight, target)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = chunked_cross_entropy(h, w, target, k)
    (loss * 0.37).backward()
    assert torch.allclose(loss, ref_loss, rtol=0, atol=1e-6 * max(1.0, abs(float(ref_loss))))
    assert (h.grad - ref_gh).abs().max() <= 1e-6
    assert (w.grad - ref_gw).abs().max() <= 1e-6
    assert h.grad[0].abs().max() == 0  # an ignored row gets no gradient


def test_all_rows_ignored_and_no_grad_forward():
    hidden, weight, target = _case(n=8)
    target[:] = IGNORE_INDEX
    h = hidden.clone().requires_grad_()
    loss = chunked_cross_entropy(h, weight, target, 3)
    loss.backward()
    assert float(loss.detach()) == 0.0 and h.grad.abs().max() == 0
    hidden, weight, target = _case()
    with torch.no_grad():
        got = chunked_cross_entropy(hidden, weight, target, 4)
    assert torch.allclose(got, _full(hidden, weight, target)[0], atol=1e-5)


def _tiny(tie: bool):
    cfg = resolve_model_config("tiny-llama")
    hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    hf._attn_implementation, hf.tie_word_embeddings, hf.use_cache = "sdpa", tie, False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf).float().train()


@pytest.mark.parametrize("tie", [False, True])
def test_model_loss_and_every_grad_equal_hf_full_logits(tie):
    # the whole path: hooks on the HF model, logits_to_keep, tied embeddings (SmolLM2 ties)
    model = _tiny(tie)
    b, s = 2, 24
    ids = torch.randint(0, model.config.vocab_size, (b, s))
    labels = ids.roll(-1, 1)
    labels[:, -3:] = IGNORE_INDEX
    batch = {"input_ids": ids, "position_ids": torch.arange(s).expand(b, s), "labels": labels}
    logits = model(input_ids=ids, position_ids=batch["position_ids"]).logits  # independent reference
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    n = (labels != IGNORE_INDEX).sum()  # the step's normalisation: token sum / target tokens
    (ref / n).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = lm_token_loss_sum(model, batch, loss_chunks=5)
    (got / n).backward()
    assert abs(float(got / n) - float(ref / n)) <= 1e-6
    for n, p in model.named_parameters():
        assert (p.grad - ref_grads[n]).abs().max() <= 1e-6, n
    model.zero_grad(set_to_none=True)
    one = lm_token_loss_sum(model, batch, loss_chunks=1)
    assert torch.equal(one, ref.detach())  # one chunk: today's computation, bit for bit


def _saved_and_peak(model, batch, k):
    """Bytes autograd saves for backward (non-parameter storages) and the step's tracked peak."""
    from shardtune.train.core.memtrack import tracked_call

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    def step():
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = lm_token_loss_sum(model, batch, k)
        loss.backward()
        model.zero_grad(set_to_none=False)

    step()  # grads allocated: the tracked step starts at rest
    _, mem = tracked_call(model, None, step, fsdp=False)
    return sum(saved.values()), mem["total"]


def test_saved_and_peak_bytes_drop_by_the_logits_term():
    model = _tiny(False)
    V, b, s, k = model.config.vocab_size, 2, 64, 8
    T = b * s
    ids = torch.randint(0, V, (b, s))
    batch = {"input_ids": ids, "position_ids": torch.arange(s).expand(b, s), "labels": ids.roll(-1, 1)}
    saved_full, peak_full = _saved_and_peak(model, batch, 1)
    saved_k, peak_k = _saved_and_peak(model, batch, k)
    # full: F.cross_entropy saves its fp32 log-softmax (T·V·4 bytes) and nll_loss's 0-dim
    # total_weight (4 B); chunked: a 4-byte log-sum-exp a row; all else is the same tensors
    assert saved_full - saved_k == 4 * T * V + 4 - 4 * T
    # peak (torch's MemTracker): the saved fp32 log-softmax is gone; a chunk's fp32 logits,
    # softmax, gradient and temporaries (at most four T/K × V fp32 tensors) come instead
    chunk = 4 * (T // k + 1) * V
    assert peak_full - peak_k >= 4 * T * V - 4 * chunk


def test_default_chunks_follow_the_vocabulary():
    assert default_loss_chunks(32_000) == 1 and default_loss_chunks(32_768) == 1  # Llama-2, Mistral
    assert default_loss_chunks(49_152) == 8 and default_loss_chunks(128_256) == 8  # SmolLM2, Llama-3


def test_planner_head_term_follows_the_chunks_by_hand():
    from shardtune.plan import plan
    from shardtune.plan.activations import head_activation_bytes
    from shardtune.plan.params import Architecture

    arch = Architecture(model_type="llama", hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=4, vocab_size=10, tie_embeddings=False)
    T = 5
    norm_and_input = T * 8 * 4 + T * 4 + T * 8 * 2 + T * 8 * 2  # fp32 input, rstd, bf16 normalised, head input
    assert head_activation_bytes(arch, T, 2) == norm_and_input + T * 10 * (2 + 4 + 4)
    # K = 2: rows of ⌈5/2⌉ = 3 — their bf16 logits and fp32 upcast — and a fp32 log-sum-exp a token
    assert head_activation_bytes(arch, T, 2, loss_chunks=2) == norm_and_input + 3 * 10 * (2 + 4) + 4 * T
    assert head_activation_bytes(arch, T, 4, loss_chunks=2) - head_activation_bytes(arch, T, 4) == \
        3 * 10 * 4 + 4 * T - T * 10 * 8  # fp32: no upcast copy
    # the plan's default for a 128k vocabulary is 8 chunks, for tiny-llama (V 264) 1
    big = {k: plan("llama-3-8b", 8, seq_len=4096, loss_chunks=k, strategies=["zero3"]).strategy("zero3")
           for k in (None, 1, 8)}
    assert big[None].memory.activations == big[8].memory.activations < big[1].memory.activations
    T, V = 4096, 128_256
    assert big[1].memory.activations - big[8].memory.activations == T * V * 10 - (512 * V * 6 + 4 * T)


@pytest.mark.parametrize("argv", [["--loss-chunks", "0"], ["--loss-chunks", "-2"]])
def test_bad_chunks_on_the_plan_flag_are_one_line_exit_2(argv, capsys):
    from shardtune.cli import main

    rc = main(["plan", "llama-3-8b", "--gpus", "8", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--loss-chunks" in err[0], err


@pytest.mark.parametrize("value", ["0", "-1"])
def test_bad_chunks_in_the_recipe_are_one_line(value):
    from shardtune.config import build_config
    from shardtune.errors import UserError

    with pytest.raises(UserError, match="loss_chunks") as e:
        build_config({"train": {"loss_chunks": int(value)}})
    assert "\n" not in str(e.value)
