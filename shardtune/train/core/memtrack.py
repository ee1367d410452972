"""Memory by the planner's categories, measured with torch's trackers over real or fake tensors.

`track_step` / `tracked_call` run a training step under `FSDPMemTracker` (FSDP2 models) or
`MemTracker` (DDP, plain models) from torch.distributed._tools and map the trackers' categories
to the planner's `Memory` keys (plan/strategy_plan.py). The simulator (verify/simulate.py) uses them on fake
tensors, the trainer (train/rank/main.py, CPU runs) and tests/dist/test_simulate_vs_real.py on real
ones: the same code on both sides, so their numbers compare directly.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Tracker categories (torch/distributed/_tools: _FSDPRefType / _MemRefType values) → planner keys.
# "buffers" is what the planner calls buffers: the unsharded bf16 params and grads in flight
# (FSDP), the all-gather / reduce-scatter buffers, autocast's weight cache and the backward's
# temporaries (ddp/zero1: autocast copies and activation grads are "Temp"), and module buffers.
_CATEGORY = {
    "Sharded Param": "params", "Parameter": "params",
    "Sharded Grad": "grads", "Gradient": "grads",
    "OptState": "optimizer", "Optstate": "optimizer",
    "Activation": "activations", "Inputs": "activations",
    "Unsharded Param": "buffers", "Unsharded Grad": "buffers", "All Gather": "buffers",
    "Reduce Scatter": "buffers", "Temp": "buffers", "Buffer": "buffers", "Other": "buffers",
}


def _snapshot(tracker) -> dict[str, int]:
    """The tracker's current bytes per category on the (one) CPU device, by category name."""
    snap = tracker.get_tracker_snapshot("current")
    out: dict[str, int] = {}
    for dev_snap in snap.values():
        for k, v in dev_snap.items():
            name = getattr(k, "value", k)
            out[name] = out.get(name, 0) + int(v)
    return out


def _group(snap: dict[str, int]) -> dict[str, int]:
    """Tracker categories summed into planner keys (unknown categories go to buffers)."""
    out = dict.fromkeys(("params", "grads", "optimizer", "activations", "buffers"), 0)
    for name, v in snap.items():
        if name != "Total":
            out[_CATEGORY.get(name, "buffers")] += v
    return out


def _make_tracker(fsdp: bool, model, optimizer):
    """FSDPMemTracker / MemTracker subclass that also records, after every op, the running
    maximum of the activations, of the buffers in forward/backward and of the optimizer step's
    total (the trackers themselves keep only the snapshot at the overall peak)."""
    # imported here, for the one tracked step: the FSDP tracker pulls in dynamo and inductor
    # (0.6 s of every rank's start-up otherwise)
    from torch.distributed._tools.fsdp2_mem_tracker import (  # noqa: PLC0415 dynamo at import: 0.6 s a rank
        FSDPMemTracker,
        _FSDPRefType,
        _FSDPState,
    )
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType  # noqa: PLC0415 as above

    base = FSDPMemTracker if fsdp else MemTracker
    _GATHER_STATES = (_FSDPState.PRE_FW, _FSDPState.PRE_BW)
    _KEY_OF = {ref: _CATEGORY.get(ref.value, "buffers") for ref in (*_FSDPRefType, *_MemRefType)}
    _KEY_OF["Total"] = "Total"

    class _Tracker(base):  # type: ignore[misc, valid-type]
        def reset_maxima(self) -> None:
            self.maxima = dict(activations=0, opt_total=0, fwd_bwd_buffers=0)
            self.peak_total = 0
            self.peak_breakdown: dict[str, int] = {}

        def _update_peak_stats(self, peak_state) -> None:  # called after every dispatched op
            # torch's version also walks every tracked module (per-module peaks, which nothing
            # here reads): ops × modules, 80 % of a simulate. Keep only the overall peak.
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                    self._peak_mem[dev] = dev_snap["Total"]
                    self._peak_mem_snap[dev] = dict(dev_snap)
            if not self._defer_maxima:
                self._record_maxima()

        def _record_maxima(self) -> None:
            acts = bufs = total = 0
            for dev_snap in self._curr_mem_snap.values():
                for k, v in dev_snap.items():
                    key = _KEY_OF.get(k)
                    if key == "activations":
                        acts += v
                    elif key == "buffers":
                        bufs += v
                    elif key == "Total":
                        total += v
            # FSDP's unshard (pre-forward / pre-backward) allocates the all-gather output and
            # exposes the unsharded parameters' storages (views) before the tracker re-tags them
            # "All Gather" / "Unsharded Param": tensors tracked meanwhile land in "Activation".
            # No activation is made there, so count that growth as buffers.
            if fsdp and getattr(self, "_fsdp_state", None) in _GATHER_STATES:
                if self._acts_before_unshard is None:
                    self._acts_before_unshard = acts
                bufs += max(0, acts - self._acts_before_unshard)
                acts = self._acts_before_unshard
            else:
                self._acts_before_unshard = None
            m = self.maxima
            if acts > m["activations"]:
                m["activations"] = acts
            if self._in_opt:
                m["opt_total"] = max(m["opt_total"], total)
            elif bufs > m["fwd_bwd_buffers"]:
                m["fwd_bwd_buffers"] = bufs
            if total > self.peak_total:
                self.peak_total = total
                self.peak_breakdown = {getattr(k, "value", k): v for d in self._curr_mem_snap.values()
                                       for k, v in d.items()}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # ddp/zero1 under autocast: a forward cast of a parameter is autocast's weight cache,
            # which the planner counts as a buffer (plan/memory.py ddp_buffer_bytes), not an
            # activation: re-tag it before the maxima see it. (FSDP casts inside fully_shard.)
            cast = not fsdp and func is torch.ops.aten._to_copy.default and not self._in_opt
            self._defer_maxima = cast
            try:
                res = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._defer_maxima = False
            if cast:
                if isinstance(res, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
                    src = self._WINFO.get(args[0].untyped_storage(), (None, None))[0]
                    if src is not None and src.reftype == _MemRefType.PARAM:
                        self._update_and_maybe_create_winfos(res, _MemRefType.TEMP)
                self._record_maxima()
            return res

    if fsdp:
        tracker = _Tracker(model, optimizer)
    else:
        tracker = _Tracker()
        tracker.track_external(model, optimizer)
    tracker._acts_before_unshard = None
    tracker._defer_maxima = False
    tracker.reset_maxima()
    return tracker


def track_step(model, optimizer, step: Callable[[], Any], fsdp: bool, warmup_steps: int = 1) -> dict:
    """Run `step` twice — a warm-up, then a tracked one — and return per-rank bytes by planner key.

    params / grads / optimizer: at rest after the tracked step (the grads live until the next
    step's zero_grad); activations: the largest activation bytes alive at any moment;
    buffers: the largest bytes in flight in forward/backward (unsharded params and grads,
    collective buffers, backward temporaries, autocast's weight cache); optimizer_step_temp: the
    optimizer step's peak above the states at rest; total: the step's peak. Works on real and fake
    tensors alike. A real DDP model rebuilds its buckets once, in the second step's forward:
    measure it after `warmup_steps=2`.
    """
    for _ in range(warmup_steps):  # untracked: the trackers tag params, grads and optimizer states on entry
        step()
    return tracked_call(model, optimizer, step, fsdp)[1]


def tracked_call(model, optimizer, step: Callable[[], Any], fsdp: bool) -> tuple[Any, dict]:
    """(step()'s result, bytes by planner key) for one call of `step` under the tracker
    (`track_step` without the warm-up; the trainer measures its third step on CPU with it)."""
    tracker = _make_tracker(fsdp, model, optimizer)
    with tracker:
        out = step()
    rest = _group(_snapshot(tracker))
    m = tracker.maxima
    states = rest["params"] + rest["grads"] + rest["optimizer"]
    activations = m["activations"]
    return out, {
        "params": rest["params"], "grads": rest["grads"], "optimizer": rest["optimizer"],
        "activations": activations,
        "buffers": m["fwd_bwd_buffers"],
        "optimizer_step_temp": max(0, m["opt_total"] - states),
        "total": tracker.peak_total,
        "breakdown_at_peak": {k: v for k, v in tracker.peak_breakdown.items() if v and k != "Total"},
    }
