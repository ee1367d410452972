"""Checkpoints with torch.distributed.checkpoint (DCP): atomic step folders, keep-last-K, resume
at any world size and under any strategy (docs/checkpoints.md: layout, atomicity, resume rules).

`checkpoints/step_<N>/` holds DCP's model and optimizer states in torch's FQN-keyed form
(`get_state_dict`, so DCP reshards on load; LoRA: frozen params not saved), trainer.json (step,
tokens seen, data position, LR scheduler), rng_rank<r>.json, hf/ (config and tokenizer files),
and shardtune_checkpoint.json, written last. Every rank writes into `.tmp-step_<N>`; rank 0
renames it (atomic on POSIX), so resume reads only complete folders. zero1's
ZeroRedundancyOptimizer has no FQN state dict: its local AdamW states are written under the same
keys (`zero1_optim_state`). Reading never runs code: safe_load.py (exact allow-list unpickler for
`.metadata`, `torch.load(weights_only=True)` for non-tensor values).
"""
from __future__ import annotations

import base64
import errno
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from shardtune.errors import UserError, read_json_object
from shardtune.parallel.ep import ep_whole_state
from shardtune.train.core.lora import check_same_base
from shardtune.train.core.model import unwrap
from shardtune.train.durable import ckpt_files, integrity, shards
from shardtune.train.durable.ckpt_files import (
    FORMAT_VERSION,
    HF_DIR,
    META_FILE,
    OLD_PREFIX,
    TRAINER_FILE,
    CheckpointInfo,
    check_resume_files,
    checkpoints_dir,
    prune,
)
from shardtune.train.durable.safe_load import (  # noqa: F401  (export.py imports the reader and planner from here)
    SafeFileSystemReader,
    SafeLoadPlanner,
    read_dcp_metadata,
    safe_dcp_load,
)


# ---------------------------------------------------------------- model + optimizer state
def _is_zero1(optimizer) -> bool:
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _fqns(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in unwrap(model).named_parameters()}


def zero1_optim_state(model, optimizer, *, for_load: bool) -> dict:
    """zero1's optimizer state in torch's FQN form; only the parameters this rank owns.
    `for_load`: zero-filled tensors of the right shapes for DCP to read into."""
    fqn = _fqns(model)
    state: dict[str, dict] = {}
    for group in optimizer.optim.param_groups:  # the local optimizer: this rank's partition
        for p in group["params"]:
            if for_load:
                state[fqn[id(p)]] = {"step": torch.zeros((), dtype=torch.float32),
                                     "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            elif p in optimizer.optim.state:
                state[fqn[id(p)]] = optimizer.optim.state[p]
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [fqn[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": state} if for_load else {"state": state, "param_groups": groups}


def _load_zero1_optim(model, optimizer, optim_sd: dict) -> None:
    fqn = _fqns(model)
    for group in optimizer.optim.param_groups:
        for p in group["params"]:
            optimizer.optim.state[p] = optim_sd["state"][fqn[id(p)]]


def _options(model):
    """Frozen parameters (LoRA's base) are not saved: the base is rebuilt from the run's model
    settings (the pointer in hf/config.json, train/core/model.py `base_pointer`), so a 70B LoRA
    checkpoint holds the adapters and their optimizer state, not 141 GB of unchanged weights."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _without_frozen(model, model_sd: dict) -> dict:
    """`ignore_frozen_params` drops a frozen parameter under its first name only (named_parameters
    lists a shared tensor once): a tied `lm_head.weight`, the embedding's second name, stayed in
    LoRA checkpoints (28.3 M of 35.6 M saved elements on SmolLM2). Every name of a frozen one goes."""
    clean = lambda n: ".".join(s for s in n.split(".") if s not in _WRAPPERS)  # noqa: E731
    frozen = {clean(n) for n, p in unwrap(model).named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen} if frozen else model_sd


_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def model_optim_state(model, optimizer, *, for_load: bool = False) -> dict:
    """{"model": ..., "optim": ...} in FQN form for DCP (DTensors under FSDP2, tensors under DDP)."""
    if _is_zero1(optimizer):
        return {"model": _without_frozen(model, get_model_state_dict(model, options=_options(model))),
                "optim": zero1_optim_state(model, optimizer, for_load=for_load)}
    model_sd, optim_sd = get_state_dict(model, optimizers=optimizer, options=_options(model))
    return {"model": _without_frozen(model, model_sd), "optim": optim_sd}


def set_model_optim_state(model, optimizer, sd: dict) -> None:
    if _is_zero1(optimizer):
        set_model_state_dict(model, sd["model"], options=_options(model))
        _load_zero1_optim(model, optimizer, sd["optim"])
        return
    set_state_dict(model, optimizers=optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                   options=_options(model))


# ---------------------------------------------------------------- small JSON parts
def _rng_state() -> dict:
    enc = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    return {"cpu": enc(torch.get_rng_state()),
            "cuda": enc(torch.cuda.get_rng_state()) if torch.cuda.is_available() else None}


def _set_rng_state(d: dict) -> None:
    dec = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(dec(d["cpu"]))
    if d.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state(dec(d["cuda"]))


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- save
def _local_bytes(sd: dict) -> int:
    """Bytes of this rank's tensors in a state dict (a DTensor's local shard)."""
    total = 0
    for v in sd.values():
        if isinstance(v, dict):
            total += _local_bytes(v)
        elif isinstance(v, torch.Tensor):
            t = v.to_local() if isinstance(v, DTensor) else v
            total += t.numel() * t.element_size()
    return total


def check_free_space(ckpt_dir: Path, sd: dict, previous: Path | None) -> None:
    """Before a save: the folder's free bytes (the least any rank sees) against what the save needs
    (the previous checkpoint's size, else the state's bytes over all ranks); one line if short.
    Collective. The old checkpoint is pruned only after the new one is complete, so both must fit."""
    need = torch.tensor([_local_bytes(sd)], dtype=torch.int64)
    free = torch.tensor([shutil.disk_usage(ckpt_dir).free], dtype=torch.int64)
    dist.all_reduce(need, op=dist.ReduceOp.SUM)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    needed = max(int(need.item()), integrity_size(previous))
    if int(free.item()) < needed:
        raise UserError(f"not enough space to save a checkpoint in {ckpt_dir}: the save needs {needed:,} bytes "
                        f"({needed / 2**30:.2f} GiB), {int(free.item()):,} are free; free space there or set "
                        "output_dir to a larger disk, then resume (the last checkpoint is intact)")


def _disk_full(e: BaseException) -> bool:
    """ENOSPC / EDQUOT here or on any rank of a DCP save (CheckpointException carries each rank's)."""
    errs = [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException) else [e]
    return any(isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT) for x in errs)


def integrity_size(previous: Path | None) -> int:
    """Bytes of a previous checkpoint's files (0 when there is none)."""
    if previous is None or not Path(previous).is_dir():
        return 0
    return sum(p.stat().st_size for p in Path(previous).rglob("*") if p.is_file())


def _all_digests(tmp: Path, rank: int, world_size: int) -> dict:
    """Every rank hashes the files it wrote (integrity.py); rank 0 gets them all. Collective."""
    names = integrity.listing(tmp, skip=(META_FILE,))
    parts: list = [None] * world_size
    dist.all_gather_object(parts, integrity.digest(tmp, integrity.mine(names, rank, world_size)))
    return {k: v for part in parts for k, v in part.items()}


def save_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler, state, *, rank: int,
                    world_size: int, strategy: str, cfg_hash: str, keep: int, run_id: str,
                    hf_files=None, in_save_hook=None, previous: Path | None = None,
                    checksums: bool = True) -> Path:
    """Write `checkpoints/step_<step>` atomically (module docstring), with each file's size and
    CRC-32 (`checksums`), and keep the newest `keep` of run `run_id`. Collective: every rank calls
    it. `hf_files(dir)` (rank 0) writes config and tokenizer files; `previous`: the last save."""
    ckpt_dir = checkpoints_dir(run_dir)
    tmp, final = ckpt_dir / f".tmp-step_{step}", ckpt_dir / f"step_{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a killed save of the same step
        tmp.mkdir(parents=True)
    dist.barrier()
    sd = model_optim_state(model, optimizer)
    try:
        check_free_space(ckpt_dir, sd, previous)
        # torch.save items, named rather than defaulted: durable/shards.py checks each is a zip archive
        writer = FileSystemWriter(tmp, sync_files=True, serialization_format=SerializationFormat.TORCH_SAVE)
        dcp.save(ep_whole_state(unwrap(model), sd), storage_writer=writer)  # experts: rows of E (parallel/ep.py)
        del sd
        _write_json(tmp / f"rng_rank{rank}.json", _rng_state())
        if rank == 0:
            _write_json(tmp / TRAINER_FILE, {"step": step, "tokens_seen": int(state.tokens_seen),
                                             "data": state.data.state_dict() if state.data is not None else None,
                                             "scheduler": scheduler.state_dict()})
            if hf_files is not None:
                (tmp / HF_DIR).mkdir()
                hf_files(tmp / HF_DIR)
        if in_save_hook is not None:
            in_save_hook()
        dist.barrier()  # every rank's files are on disk
        files = _all_digests(tmp, rank, world_size) if checksums else None
        if rank == 0:
            meta = {"format": FORMAT_VERSION, "step": step, "world_size": world_size, "strategy": strategy,
                    "config_hash": cfg_hash, "run_id": run_id, "saved_at": time.time(), "complete": True}
            if files is not None:
                meta |= {"checksum": integrity.ALGORITHM, "files": files}
            _write_json(tmp / META_FILE, meta)
    except (OSError, CheckpointException, UserError) as e:
        if rank == 0:  # nothing of a failed save is left behind
            shutil.rmtree(tmp, ignore_errors=True)
        if not _disk_full(e):
            raise
        kept = f"the last checkpoint {Path(previous).name} is intact" if previous else "no checkpoint was lost"
        st = os.statvfs(ckpt_dir)
        raise UserError(f"disk full while saving step {step} in {ckpt_dir} ({st.f_bavail * st.f_frsize:,} bytes and "
                        f"{st.f_favail:,} inodes free after removing the partial save); free space there or set "
                        f"output_dir to a larger disk, then resume ({kept})") from None
    if rank == 0:
        _fsync_dir(tmp)
        _swap_in(tmp, final, step, run_id)
        prune(run_dir, keep, run_id)
    dist.barrier()
    return final


def _swap_in(tmp: Path, final: Path, step: int, run_id: str) -> None:
    """tmp → final. A re-save of this run's existing step (resumed from an older one) moves the old
    copy to `.old-step_N` first; between the two renames that copy is still found (ckpt_files reads
    `.old-` copies of absent steps), and a start restores it (`remove_stale_temporaries`). Anything
    else under that name (another run's checkpoint, one of another step copied in, a damaged one)
    is moved aside to `aside-<time>-step_N`, named in a line, never deleted."""
    old = final.parent / f"{OLD_PREFIX}{final.name}"
    there = ckpt_files.read_info(final) if final.exists() else None
    if final.exists() and not (there is not None and there.step == step and run_id and there.run_id == run_id):
        aside = final.parent / time.strftime(f"aside-%Y%m%d-%H%M%S-{final.name}")
        final.rename(aside)
        print(f"shardtune: moved {final} aside to {aside.name} (it was not this run's step {step}) before "
              "saving there", file=sys.stderr, flush=True)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- load
def verify_checkpoint(info: CheckpointInfo, rank: int, world_size: int) -> list[str]:
    """What is wrong with the checkpoint's files against the checksums it was saved with, then its
    shards against `.metadata` (shards.py: checksums rewritten to match do not hide a cut or
    zeroed shard). Every rank checks its share (integrity.py); the same list on every rank.
    Collective. [] when it verifies (a checkpoint saved before checksums: the caller says so)."""
    parts: list = [None] * world_size
    dist.all_gather_object(parts, shards.damage(info, rank, world_size))
    return [p for part in parts for p in part]


def load_checkpoint(info: CheckpointInfo, model, optimizer, scheduler, state, *, rank: int) -> None:
    """Load `info` into the model, optimizer, scheduler and train state, resharding as needed.
    Collective: every rank calls it. A LoRA checkpoint holds no base weights: the model's base
    must be the one it was trained on (train/core/lora.py `check_same_base`)."""
    hf_config = info.path / HF_DIR / "config.json"
    if hf_config.is_file():
        check_same_base(read_json_object(hf_config, "checkpoint file", "resume another checkpoint"), unwrap(model))
    trainer = check_resume_files(info)  # before any tensor is read: one line, not a traceback per rank
    reader = SafeFileSystemReader(info.path)
    reader.read_metadata()  # the allow-list's error as itself, before DCP wraps errors in its own
    sd = model_optim_state(model, optimizer, for_load=True)
    safe_dcp_load(ep_whole_state(unwrap(model), sd), reader)  # fills sd's tensors
    set_model_optim_state(model, optimizer, sd)
    scheduler.load_state_dict(trainer["scheduler"])
    # LambdaLR restores its counter, not the optimizer's lr: set it to what the next step uses
    # (in place where the lr is a tensor: torchao's 8-bit AdamW's compiled step refuses a float)
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(float(lr))
        else:
            group["lr"] = lr
    state.step, state.tokens_seen = int(trainer["step"]), int(trainer["tokens_seen"])
    if state.data is not None and trainer.get("data") is not None:
        state.data.load_state_dict(trainer["data"])
    rng = info.path / f"rng_rank{rank}.json"
    if rng.is_file():  # absent when resuming on more ranks than saved: those keep their seed
        try:
            _set_rng_state(json.loads(rng.read_text()))
        except (ValueError, RuntimeError, KeyError, TypeError) as e:  # a state of another length, say
            raise UserError(f"checkpoint file {str(rng)!r} holds no generator state torch accepts "
                            f"({type(e).__name__}); resume another checkpoint") from None
