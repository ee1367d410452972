"""Activation offload's hooks (train/core/offload.py) on one process: the path a GPU run takes,
forced on CPU (every tensor not a parameter counts as on the device), through the trainer's
`train_step` with AC full on tiny-llama. What moves is what the forward saves outside the
checkpointed layers (their inputs: non-reentrant checkpoint saves them through the outer hooks),
the gradients equal the run without offload bit for bit, and nothing is left on the "device"."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from shardtune.config import ModelConfig
from shardtune.parallel.ac import apply_activation_checkpointing
from shardtune.train.core import offload
from shardtune.train.core.metrics import SavedActivations
from shardtune.train.core.model import build_hf_config, init_model_weights
from shardtune.train.core.offload import HostOffload


def _model(ac: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(build_hf_config(ModelConfig()), attn_implementation="sdpa")
    init_model_weights(model, ModelConfig(name="tiny-llama"), seed=0)
    apply_activation_checkpointing(model, ac, 2)
    return model


def _grads(model, counter, hooks_offload):
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 32))
    pos = torch.arange(32).expand(2, -1)
    with counter.micro_batch(hooks_offload):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1)[:-1], ids.flatten()[1:])
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("ac", ["full", "none"])
def test_offload_moves_what_is_saved_and_changes_no_gradient(monkeypatch, ac):
    plain = SavedActivations()
    want = _grads(_model(ac), plain, None)
    assert plain.peak_bytes > 0 and plain.peak_offloaded_bytes == 0
    # a GPU run: every activation is on the device (here: anything not a parameter or DTensor)
    monkeypatch.setattr(offload, "_stays", lambda t: isinstance(t, (torch.nn.Parameter, DTensor))
                        or isinstance(t._base, torch.nn.Parameter))
    moved = SavedActivations()
    got = _grads(_model(ac), moved, HostOffload())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert moved.peak_bytes == 0  # nothing saved stays on the device
    # the same tensors in host memory: a storage saved twice (by two ops) is copied twice, as torch's
    # save_on_cpu does, so at least as many bytes
    assert plain.peak_bytes <= moved.peak_offloaded_bytes <= 1.5 * plain.peak_bytes
    if ac == "full":  # the block inputs at least: 4 layers x (2, 32, 128) fp32
        assert moved.peak_offloaded_bytes >= 4 * 2 * 32 * 128 * 4


def test_on_a_cpu_run_nothing_moves():
    counter = SavedActivations()
    _grads(_model("full"), counter, HostOffload())
    assert counter.peak_offloaded_bytes == 0 and counter.peak_bytes > 0
