"""Plan by simulation: the trainer's build and train step traced on fake tensors at world size N.

`shardtune plan MODEL --gpus N --simulate` builds the model with the trainer's own code (the meta
build of train/core/model.py, then parallel/build.py `build_parallel_model` with the same
`ParallelConfig`, no fill: values do not change memory), its `build_optimizer`, `build_scheduler`
and `train_step`, under `FakeTensorMode` (no memory, no compute) with torch's "fake" process-group
backend (rank 0 of N) on the CPU. One step runs under torch's memory trackers
(train/core/memtrack.py `track_step`), whose categories map to the planner's `Memory` keys; the
same `track_step` on a real gloo run is how tests/dist/test_simulate_vs_real.py checks the trace.
Where a fake trace differs from the trainer, and why, and what it cannot trace:
docs/verification.md.
"""
from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import _sharding_prop
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from shardtune.config import build_config
from shardtune.parallel.build import build_parallel_model
from shardtune.parallel.fsdp import apply_precision
from shardtune.parallel.mesh import build_layout, build_mesh, dp_group
from shardtune.plan.validate import PlanInputs, resolve_inputs
from shardtune.rules.preference import holds_reference
from shardtune.strategies import STRATEGY
from shardtune.train.core.dpo import DPO, add_reference_bytes
from shardtune.train.core.dpo_ref import ModelReference, build_reference_model, reference_parallel_config
from shardtune.train.core.memtrack import track_step
from shardtune.train.core.model import build_meta_model
from shardtune.train.core.optim import build_optimizer, build_scheduler
from shardtune.train.core.step import StepOptions, train_step
from shardtune.verify.moe_fake import moe_on_fake_tensors
from shardtune.verify.trace_inputs import mark_untraced, trace_recipe, untraceable_reason


def _model_file(spec: Any, tmp: Path) -> str:
    """A spec `ModelConfig(name=...)` accepts: catalogue name / path as is, a dict as config.json."""
    if isinstance(spec, dict):
        path = tmp / "config.json"
        path.write_text(json.dumps(spec))
        return str(path)
    return str(spec)


@contextmanager
def fake_world(world_size: int):
    """The "fake" default process group at `world_size` (this process is rank 0), torn down after."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; simulate in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def separate_dtensor_propagation():
    """Run DTensor's sharding propagation in its own FakeTensorMode, not in ours.

    DTensor derives each op's global output shape by running the op on global-shape fake tensors
    in `detect_fake_mode() or FakeTensorMode()` (torch/distributed/tensor/_sharding_prop.py).
    In a real run that is a private mode the trackers skip; under our FakeTensorMode it is ours,
    so the trackers counted full-size (unsharded) tensors for every DTensor op: clip_grad_norm_'s
    foreach norm and the foreach AdamW step over-reported by ~N× (PYTORCH-NOTES: 13.5 × 8P/N)."""
    detect = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *a, **k: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = detect


@contextmanager
def real_device_meshes():
    """Build DeviceMeshes outside our FakeTensorMode. FSDP2 on tensor-parallel (DTensor) params
    joins the dp and tp meshes while it wraps (`_fsdp_param.py` `_init_sharding_spec_tp` →
    `DeviceMesh._concatenate`), and a mesh locates this rank with `nonzero` on its rank tensor,
    which a fake tensor cannot answer (DynamicOutputShapeException). A mesh is bookkeeping over
    ranks, no model memory: it is made on real tensors, as in a real run."""
    init = DeviceMesh.__init__

    def real_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    DeviceMesh.__init__ = real_init
    try:
        yield
    finally:
        DeviceMesh.__init__ = init


def _ddp_fake_patches(model) -> None:
    """Let DDP's C++ reducer run on the fake backend. The two patches that must stay:"""
    def in_place_all_reduce(_state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    # the fake backend's all-reduce gives the reducer no tensor back; all-reduce is in place, so
    # returning the bucket itself is the same memory
    model.register_comm_hook(None, in_place_all_reduce)

    class _KeepBuckets:
        def __init__(self, reducer) -> None:
            object.__setattr__(self, "_reducer", reducer)

        def __getattr__(self, name: str):
            return getattr(self._reducer, name)

        def _rebuild_buckets(self) -> bool:
            return False

    # the one-time bucket rebuild reads the bucket order rank 0 broadcasts (data the fake backend
    # does not send): keep the buckets as built, the same buckets and bytes
    model.reducer = _KeepBuckets(model.reducer)


def make_step(model, optimizer, scheduler, opts: StepOptions, *, vocab_size: int, seq_len: int,
              micro_batch: int, grad_accum: int, world_size: int, pairs: DPO | None = None,
              precomputed: bool = False) -> Callable[[], None]:
    """One `train_step` on random token ids, two documents packed per row (position ids
    0..S/2-1, 0..S/2-1) as the trainer's packed data has them (train/data/dataset.py). `pairs`
    (dpo, simpo): the objective's own step instead (train/core/dpo.py `DPO.step`), the two
    documents of a row being one pair's chosen and rejected sides as train/data/preference.py packs
    them, with `precomputed` reference log-probs in the batch (train.reference: precompute). Packed position
    ids make transformers build a block-diagonal mask (masking_utils.find_packed_sequence_indices;
    on fake tensors it always does, as it cannot look at the ids), so a real run and the trace
    take the same attention path: a mask, K/V repeated to every query head (repeat_kv) and
    SDPA's additive mask in the compute dtype, saved for backward."""
    def step() -> None:
        batches = [fake_batch(vocab_size, seq_len, micro_batch, precomputed) for _ in range(grad_accum)]
        # the step returns tensors; only its non-finite check reads a value, which fake tensors
        # cannot answer: the trace always takes the update
        (pairs.step if pairs else train_step)(model, optimizer, scheduler, batches,
                                              replace(opts, skip_non_finite=False), dp_group=None, dp_size=world_size)
    return step


def fake_batch(vocab_size: int, seq_len: int, micro_batch: int, precomputed: bool = False) -> dict:
    """One micro-batch of `make_step`: random ids, two documents a row (a pair's two sides)."""
    ids = torch.randint(0, vocab_size, (micro_batch, seq_len))  # (B, S)
    half = seq_len // 2
    pos = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).expand(micro_batch, seq_len)
    batch = {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}
    if precomputed:  # as PairLoader's ref_slots: (B, P, 2) float32
        batch["ref_logps"] = torch.zeros(micro_batch, (seq_len + seq_len % 2) // 2, 2)
    return batch


@contextmanager
def module_stats_per_micro_batch(model):
    """Let torch's trackers follow gradient accumulation: one tracker around the whole step.

    `MemTracker` / `FSDPMemTracker` keep per-module statistics and refuse a second forward of the
    root module in one context ("does not support memory tracking for multiple iterative calls",
    torch/distributed/_tools/mem_tracker.py `_pre_fw_hook`, fsdp2_mem_tracker.py
    `_fsdp_state_pre_forward`), which is what train_step does with grad_accum > 1. A global
    forward pre-hook, registered before the tracker enters so that it runs before the tracker's
    own hooks (global hooks run in registration order, before a module's own), clears those
    per-module statistics (`reset_mod_stats`, the fix the error names) when `model` starts
    another micro-batch's forward. Only the module statistics go: the tensor tags (params, grads,
    optimizer states, activations) and the running totals `track_step` reads stay, so FSDP's
    sharded grads from earlier micro-batches stay counted, as they stay allocated in a real run."""
    def reset(module, _args) -> None:
        if module is not model:
            return
        for mode in _get_current_dispatch_mode_stack():
            if isinstance(mode, MemTracker) and not mode._mod_tracker.is_bw and module in mode.memory_tracking:
                mode.reset_mod_stats()

    handle = register_module_forward_pre_hook(reset)
    try:
        yield
    finally:
        handle.remove()


class TiedGradSumInPlace(TorchDispatchMode):
    """Sum a tied embedding's two gradients in place where autograd does on real tensors.

    A weight used twice (embedding and LM head) gets its gradients summed in autograd's input
    buffer when the embedding's, the last, arrives. On plain tensors that sum is `old.add_(new)`
    when `old` is a dense tensor of its own, not a view (the chunked loss's dW; one chunk's
    nn.Linear head hands a view: `old + new`); a tensor subclass, FakeTensor included, always gets
    `old + new` (torch/csrc/autograd/input_buffer.cpp `can_accumulate_inplace`): one more (V, h)
    tensor the trace counted and a real run never makes (docs/calibration.md, tied embeddings).
    The embedding's own backward makes no `add`: one under EmbeddingBackward0 is that sum."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func is torch.ops.aten.add.Tensor and not kwargs and args[0]._base is None
                and args[0].is_contiguous()
                and type(torch._C._current_autograd_node()).__name__ == "EmbeddingBackward0"):
            return args[0].add_(args[1])
        return func(*args, **(kwargs or {}))


def make_optimizer_states(model, optimizer) -> None:
    """AdamW makes its states in its first step: one step on zero grads makes them without a
    forward and backward (the states' bytes do not depend on the values). The tracked step then
    starts where a real second step starts (tests/dist/test_simulate_vs_real.py compares it with a
    real run that warms up with a full step)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def simulate_strategy(inputs: PlanInputs | Mapping[str, Any], strategy: str) -> dict:
    """Rank 0's bytes by planner key (`track_step`) for one strategy, traced on fake tensors.

    `inputs`: the planner's inputs, a `PlanInputs` or its fields (model: catalogue name, config.json,
    model folder or HF config dict; gpus, seq_len, ...), validated and resolved as `plan` resolves
    them. The trainer's RunConfig is built from them through config/plan_keys.py (verify/trace_inputs.py
    `trace_recipe`); what the trace cannot run is a ValueError saying why (`untraceable_reason`).
    optim.implementation auto is the kernel the trainer builds (fused, strategies.resolve_optimizer_impl)
    on any device; tp > 1: the trainer's tensor parallelism (parallel/tp.py `apply_tp`) on its mesh (parallel/mesh.py);
    objective dpo / simpo: the pair step (`make_step`); dpo with a live reference: the trainer's frozen
    copy (train/core/dpo_ref.py `build_reference_model`: sharded per layer, compute dtype) and its
    no-grad forward each micro-batch, its bytes as `reference` (in `total`)."""
    t0 = time.perf_counter()
    inp = resolve_inputs(inputs) if isinstance(inputs, PlanInputs) else resolve_inputs(fields=dict(inputs))
    reason = untraceable_reason(inp, strategy)
    if reason:
        raise ValueError(f"--simulate cannot trace {strategy}: {reason}")
    s = STRATEGY[strategy]
    gpus, per_node = inp.gpus, inp.gpus_per_node
    live = holds_reference(inp.objective, inp.reference, 0)
    with (tempfile.TemporaryDirectory() as tmp, fake_world(gpus), separate_dtensor_propagation(),
          real_device_meshes(), moe_on_fake_tensors()):
        run_cfg = build_config(trace_recipe(inp, strategy, _model_file(inp.model, Path(tmp))))
        parallel_cfg, optim_cfg, train_cfg = run_cfg.parallel, run_cfg.optim, run_cfg.train
        mesh = build_mesh(parallel_cfg, gpus, per_node, "cpu")  # outside fake mode
        # the meta model is built outside the fake mode: `to_empty` of a fake meta parameter must
        # swap tensors, which fake tensors refuse (weakrefs); inputs may be real only for the build
        meta = build_meta_model(run_cfg.model)
        # precision on the real meta tensors too: cast inside the fake mode, a parameter becomes a
        # fake meta tensor that ddp's `to_empty` must swap (refused: pure bf16 ddp/zero1 failed);
        # build_parallel_model's own cast then changes nothing
        apply_precision(meta, parallel_cfg)
        ref_meta = build_meta_model(run_cfg.model) if live else None  # the reference's, as the policy's
        if live:
            apply_precision(ref_meta, reference_parallel_config(parallel_cfg))
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            net = build_parallel_model(meta, parallel_cfg, mesh, "cpu")
            ref = build_reference_model(run_cfg, mesh, "cpu", meta=ref_meta, fill=False) if live else None
            fake.allow_non_fake_inputs = False
            if not s.fsdp:
                _ddp_fake_patches(net)
            optimizer = build_optimizer(net, optim_cfg, parallel_cfg, dp_group(mesh))
            scheduler = build_scheduler(optimizer, optim_cfg, total_steps=10)
            vocab = getattr(net, "module", net).config.vocab_size
            # the trainer's StepOptions for this run's config (train/core/step.py)
            pairs = DPO(ModelReference(ref) if live else None) if train_cfg.objective != "sft" else None
            step_opts = StepOptions.from_config(run_cfg, vocab)
            seq_len, micro_batch = train_cfg.seq_len, train_cfg.micro_batch
            step = make_step(net, optimizer, scheduler, step_opts, vocab_size=vocab,
                             seq_len=seq_len, micro_batch=micro_batch, grad_accum=train_cfg.grad_accum,
                             world_size=build_layout(parallel_cfg, gpus, per_node).dp,  # TP ranks share a batch
                             pairs=pairs, precomputed=train_cfg.objective == "dpo" and not live)
            if s.fsdp:  # instead of a warm-up step: half the trace time. (DDP's grads become views
                # of its buckets only in a real backward: it keeps the warm-up step.)
                make_optimizer_states(net, optimizer)
                if live:  # the reference's first forward (FSDP2's lazy init) outside the trackers, as
                    # in a real run's tracked third step
                    pairs.reference.logps(fake_batch(vocab, seq_len, micro_batch), step_opts)
            with module_stats_per_micro_batch(net), TiedGradSumInPlace():
                # zero1: the tracker tags the local AdamW's states (ZeroRedundancyOptimizer.state is
                # empty), or they would count only from the step on: a backward peak without them
                local = getattr(optimizer, "optim", optimizer)
                result = track_step(net, local, step, fsdp=s.fsdp, warmup_steps=0 if s.fsdp else 1)
            result = add_reference_bytes(result, pairs.reference if pairs else None)
        del meta, net, optimizer, scheduler, step, ref, ref_meta, pairs
        gc.collect()  # drop DDP's reducer before the fake group goes (PYTORCH-NOTES: gloo exit hang)
    result["tracker"] = "FSDPMemTracker" if s.fsdp else "MemTracker"
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    return result


def _progress_console():
    return Console(stderr=True, highlight=False)  # stdout stays clean for --json


def attach_simulation(result, model: Any, console=None) -> None:
    """Trace every strategy of a `PlanResult` the trace can run (`simulate_strategy` on the plan's own
    inputs) and store the outcome in each `StrategyPlan.simulated`: the `memory` keys plus "status":
    "traced", or {"status": "analytic fallback", "reason": ...} after one line on stderr where it
    cannot (verify/trace_inputs.py `mark_untraced`) or the trace fails.
    `model`: the plan's model spec (as `simulate_strategy`; None when the plan had --params)."""
    console = console or _progress_console()
    if mark_untraced(result):
        return
    inputs = PlanInputs(**result.inputs, model=model)
    todo = [sp for sp in result.strategies if sp.simulated is None]
    columns = (TextColumn("[bold]simulate"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
    with Progress(*columns, console=console, transient=not console.is_terminal) as bar:
        task = bar.add_task("simulate", total=len(todo), info="")
        for sp in todo:
            bar.update(task, info=f"{sp.name} on fake tensors, world {inputs.gpus}")
            try:
                sp.simulated = {"status": "traced", **simulate_strategy(inputs, sp.name)}
            except Exception as e:  # a model or op the fake trace cannot run: say so, keep the plan
                reason = f"the trace failed ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
                sp.simulated = {"status": "analytic fallback", "reason": reason}
                print(f"shardtune: --simulate cannot trace {sp.name}: {reason}; showing the analytic plan "
                      "(marked 'analytic')", file=sys.stderr)
            bar.update(task, advance=1)
