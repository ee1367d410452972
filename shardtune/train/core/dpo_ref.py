"""DPO's reference model, held the sharded way (docs/dpo.md):

- LoRA: the policy itself with its adapters switched off (PEFT's per-layer `_disable_adapters`
  flag, what `PeftModel.disable_adapter()` sets): no second copy.
- full fine-tune: a frozen copy built like the policy (meta → per-decoder-layer FSDP2 shards →
  filled tensor by tensor, never gathered whole), stored in the training precision's compute dtype
  (bf16 under bf16-mixed and bf16, fp32 under fp32), resharded after every forward.
- `train.reference: precompute`: the reference log-probs of every pair computed once before
  training (each rank its share of rows, one all-reduce), cached as ref_logps.npy beside the
  tokenised data (or in the run folder without a data cache), keyed by the data cache key, the
  weights (files' sizes and mtimes, or the seeded init) and the compute dtype; reused on resume.
  The temporary reference is freed before training.
Validation pairs get their reference log-probs once at set-up, whatever the mode.
"""
from __future__ import annotations

import gc
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shardtune.catalog.models import resolve_model_config, safetensors_files
from shardtune.parallel.build import build_parallel_model
from shardtune.parallel.fsdp import apply_precision
from shardtune.strategies import IGNORE_INDEX, STRATEGY
from shardtune.train.core.dpo import DPO, reference_preference, sequence_logps
from shardtune.train.core.model import build_meta_model, init_model_weights, uses_pretrained
from shardtune.train.data.dataset import resolve_cache_dir
from shardtune.train.data.packing import build_row
from shardtune.train.data.preference import pair_cache_inputs

REF_VERSION = 1
FILE = "ref_logps.npy"


class ModelReference:
    """Reference log-probs from a frozen model (no grad, eval mode)."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def logps(self, batch: dict, opts) -> torch.Tensor:
        return sequence_logps(self.model, batch, opts.loss_chunks, opts.autocast_dtype)


class AdaptersOffReference:
    """Reference log-probs from the LoRA policy with every adapter switched off (no grad)."""

    def __init__(self, policy):
        from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: PLC0415 optional extra (peft)

        self.policy = getattr(policy, "module", policy)  # DDP: the module (no grad, no reducer)
        self.layers = [m for m in self.policy.modules() if isinstance(m, BaseTunerLayer)]

    @contextmanager
    def off(self):
        """The block runs the base: every adapter switched off, back on after."""
        for m in self.layers:
            m._disable_adapters = True  # not enable_adapters(False): it would flip requires_grad
        try:
            yield
        finally:
            for m in self.layers:
                m._disable_adapters = False

    @torch.no_grad()
    def logps(self, batch: dict, opts) -> torch.Tensor:
        with self.off():
            return sequence_logps(self.policy, batch, opts.loss_chunks, opts.autocast_dtype)


def compute_dtype_precision(precision: str) -> str:
    """The reference's stored precision: the training precision's compute dtype."""
    return "fp32" if precision == "fp32" else "bf16"


def build_reference_model(cfg, mesh, device, *, meta=None, fill: bool = True):
    """The frozen full copy: sharded per decoder layer like the policy (FSDP strategies), whole per
    rank under ddp/zero1 (as their policy is); in the compute dtype; eval mode. `meta`: a meta copy
    built already; `fill=False` leaves the values unset (the simulator: fake tensors, verify/simulate.py)."""
    if meta is None:
        meta = build_meta_model(cfg.model)
    meta.requires_grad_(False)
    pcfg = reference_parallel_config(cfg.parallel)

    def init(m):
        init_model_weights(m, cfg.model, cfg.train.seed)

    if STRATEGY[pcfg.strategy].fsdp:
        model = build_parallel_model(meta, pcfg, mesh, device, fill=init if fill else None)
        model.set_reshard_after_forward(True)  # zero2 too: no backward ever comes to reshard it
    else:
        apply_precision(meta, pcfg)
        meta.to_empty(device=device)
        meta.tie_weights()
        if fill:
            init(meta)
        model = meta
    return model.eval()


def reference_parallel_config(parallel):
    """The reference copy's ParallelConfig: the policy's, in the compute dtype, no checkpointing."""
    return parallel.model_copy(update={"precision": compute_dtype_precision(parallel.precision),
                                       "activation_checkpointing": "none"})


def _blank(seq_len: int, pad_id: int):
    return [pad_id] * seq_len, [IGNORE_INDEX] * seq_len, list(range(seq_len))


def _batch(built: list, device) -> dict:
    return {key: torch.tensor([r[i] for r in built], dtype=torch.long, device=device)
            for i, key in enumerate(("input_ids", "labels", "position_ids"))}


def precompute_logps(reference, data, micro_batch: int, rank: int, world: int, device, opts,
                     pad_id: int, group=None) -> np.ndarray:
    """Every example's reference log-prob (float64, by example id); rows dealt round-robin to the
    data-parallel ranks (`rank` of `world` in `group`: the ranks of one tp group run the same rows,
    their forward is one collective), every rank running the same number of forwards (blank rows
    pad), one all-reduce over `group`."""
    mine = list(range(rank, data.num_rows, world))
    per_rank = -(-data.num_rows // world)
    n_batches = -(-per_rank // micro_batch)
    out = torch.zeros(len(data.offsets) - 1, dtype=torch.float64, device=device)
    for b in range(n_batches):
        idx = mine[b * micro_batch:(b + 1) * micro_batch]
        built = [build_row(data, data.rows[i], pad_id) for i in idx]
        built += [_blank(data.seq_len, pad_id)] * (micro_batch - len(built))
        logps = reference.logps(_batch(built, device), opts).double()
        for j, i in enumerate(idx):
            row = data.rows[i]
            for s in range(len(row) // 2):
                out[row[2 * s]], out[row[2 * s + 1]] = logps[j, s, 0], logps[j, s, 1]
    dist.all_reduce(out, group=group)  # each example was computed by exactly one data-parallel rank
    return out.cpu().numpy()


def _weights_fingerprint(cfg) -> list:
    if uses_pretrained(cfg.model):
        return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in safetensors_files(cfg.model.name)]
    return ["random", resolve_model_config(cfg.model.name), cfg.train.seed]


def ref_cache_entry(cfg, tokenizer, run_dir: Path) -> tuple[Path, dict]:
    """(the folder of this run's precomputed reference log-probs, what they depend on)."""
    from shardtune.train.data.cache import key_of  # noqa: PLC0415 cache.py needs pyarrow: optional (shardtune[data])

    inputs = json.loads(json.dumps({
        "version": REF_VERSION, "data": pair_cache_inputs(cfg.data, cfg.train.seq_len, tokenizer, cfg.train.seed),
        "weights": _weights_fingerprint(cfg), "compute": compute_dtype_precision(cfg.parallel.precision),
        "loss_chunks": cfg.train.loss_chunks}, sort_keys=True, default=str))
    root = resolve_cache_dir(cfg.data.cache_dir)
    return (Path(root) if root else run_dir / "ref_logps") / f"ref-{key_of(inputs)}", inputs


def _load(folder: Path, inputs: dict, num_examples: int, say: bool = True) -> np.ndarray | None:
    """The cached array, or None when absent or not of these inputs (said in one line by the rank
    that `say`s, rank 0: once a job, not once per rank; then rebuilt)."""
    from shardtune.train.data.cache import verify_entry  # noqa: PLC0415 pyarrow: optional (shardtune[data])

    if not folder.is_dir():
        return None
    problem = verify_entry(folder, folder.name, inputs)
    if problem is None:
        arr = np.load(folder / FILE, allow_pickle=False)
        if arr.shape == (num_examples,):
            return arr
        problem = f"it holds {arr.shape} log-probs, not {num_examples}"
    if say:
        print(f"shardtune: reference cache {str(folder)!r} is not this run's ({problem}); recomputing it",
              file=sys.stderr, flush=True)
    return None


def _save(folder: Path, inputs: dict, arr: np.ndarray) -> None:
    """The array and its meta.json (key, inputs, size and sha256: data cache's verify_entry format)."""
    from shardtune.train.data.cache import _sha, place_entry  # noqa: PLC0415 pyarrow: optional (shardtune[data])

    def fill(tmp: Path) -> None:
        np.save(tmp / FILE, arr, allow_pickle=False)
        meta = {"key": folder.name, "inputs": inputs, "files": {FILE: [(tmp / FILE).stat().st_size,
                                                                        _sha(tmp / FILE)]}}
        (tmp / "meta.json").write_text(json.dumps(meta))

    place_entry(folder, fill)


def set_up_dpo(cfg, ctx, model, loader, val_batches, tokenizer, run_dir: Path, opts) -> DPO:
    """The DPO objective of this run: its reference, precomputed (and cached) if asked, and the
    validation pairs' reference log-probs. simpo has no reference."""
    if cfg.train.objective == "simpo":
        return DPO(None)
    lora = cfg.lora.rank > 0
    ref_model = None
    if lora:
        reference = AdaptersOffReference(model)
    else:
        ref_model = build_reference_model(cfg, ctx.mesh, ctx.device)
        reference = ModelReference(ref_model)
    if val_batches:
        for b in val_batches:
            b["ref_logps"] = reference.logps({k: v.to(ctx.device) for k, v in b.items()}, opts).cpu()
        prefer, pairs = reference_preference(val_batches, ctx.device, ctx.dp_group)
        if ctx.rank == 0:  # before training: the policy is the reference
            print(f"shardtune: held-out pairs: the model before training prefers the chosen side in {prefer} of "
                  f"{pairs} ({prefer / max(pairs, 1):.1%}); val_pref_acc in metrics.jsonl is the same after",
                  flush=True)
    if cfg.train.reference == "precompute":
        folder, inputs = ref_cache_entry(cfg, tokenizer, run_dir)
        num_examples = len(loader.data.offsets) - 1
        arr = _load(folder, inputs, num_examples, say=ctx.rank == 0)
        have = torch.tensor([arr is not None], dtype=torch.int32, device=ctx.device)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)  # every rank loads, or every rank computes
        if not int(have):
            arr = precompute_logps(reference, loader.data, cfg.train.micro_batch, ctx.dp_rank, ctx.dp_size,
                                   ctx.device, opts, tokenizer.pad_id, ctx.dp_group)
            if ctx.rank == 0:
                _save(folder, inputs, arr)
            dist.barrier()
        if ctx.rank == 0:
            print(f"shardtune: reference log-probs of {num_examples // 2:,} pairs: {folder / FILE}", flush=True)
        loader.ref = arr
        reference, ref_model = None, None  # the frozen copy is freed before training
        gc.collect()
    return DPO(reference)
