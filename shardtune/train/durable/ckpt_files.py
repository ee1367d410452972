"""The files of a run's checkpoints, without torch (the CLI checks `--resume` before any process
starts): discovery of complete checkpoints, resume resolution, pruning, metrics truncation.
Layout and atomicity rules: train/durable/checkpoint.py; checksums: integrity.py.

"Newest" is the checkpoint saved last (`saved_at` in its metadata), not the highest step: a run
resumed from an older step, or a fresh run in a folder with old higher steps, continues from what
it wrote itself. Pruning removes only checkpoints of the same run (`run_id`, kept across resumes).
"""
from __future__ import annotations

import base64
import hashlib
import json
import math
import pickle
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shardtune.errors import UserError, read_json_object
from shardtune.strategies import STRATEGIES

if TYPE_CHECKING:
    from shardtune.config import CheckpointConfig, RunConfig

META_FILE = "shardtune_checkpoint.json"
TRAINER_FILE = "trainer.json"
HF_DIR = "hf"
FORMAT_VERSION = 1
OLD_PREFIX = ".old-"  # a re-saved step's previous copy, until the new one is in place


# The exact (module, name) pairs a DCP `.metadata` pickle may name, and the torch dtypes it may
# name: safe_load.py resolves them; `check_metadata_pickle` checks them here, torch-free, before launch.
_DCP_MD = "torch.distributed.checkpoint.metadata"
DCP_METADATA_GLOBALS = frozenset({(_DCP_MD, n) for n in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict"),
    ("torch", "Size"), ("builtins", "set"), ("builtins", "frozenset"), ("torch", "device"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath")})  # pathlib._local: Python 3.13
DTYPE_NAMES = frozenset(
    "float32 float float64 double float16 half bfloat16 complex32 chalf complex64 cfloat complex128 cdouble "
    "uint8 uint16 uint32 uint64 int8 int16 short int32 int int64 long bool float8_e4m3fn float8_e4m3fnuz "
    "float8_e5m2 float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2".split())


class UnreadableMetadata(UserError):
    """A `.metadata` cut short or garbled: damage (resume auto falls back past it), not tampering."""


def refused_global(module: str, name: str) -> UserError:
    return UserError(f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint never needs; "
                     "refusing to load it (was the checkpoint tampered with?)")


class _Stub:
    """Stands for every allowed class in the launcher's dry run: takes any arguments and state."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, dict):  # kept as plain data: shards.py reads _StorageInfo's place in its file
            self.__dict__.update(state)

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


class _DryRun(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS or (module == "torch" and name in DTYPE_NAMES):
            return type(name, (_Stub,), {"pickled_as": (module, name)})  # one stub class per global
        raise refused_global(module, name)

    def persistent_load(self, pid):
        raise UserError("checkpoint metadata holds a persistent id, which DCP metadata never does; refusing "
                        "to load it (was the checkpoint tampered with?)")


def check_metadata_pickle(path: Path) -> _Stub:
    """The `.metadata` pickle names only allowed globals (one line if not), checked without torch and
    without calling anything real: every allowed class is a stub here (the launcher's check).
    Returns the Metadata stub, its pickled state as attributes."""
    try:
        with open(path, "rb") as f:
            root = _DryRun(f).load()
    except UserError:
        raise
    except Exception as e:  # truncated, garbage, an unregistered extension code
        raise UnreadableMetadata(f"{path} is not a readable DCP metadata file ({type(e).__name__}); was the checkpoint "
                        "damaged or tampered with?") from None
    if getattr(type(root), "pickled_as", None) != (_DCP_MD, "Metadata"):
        raise UserError(f"{path} holds a {type(root).__name__}, not DCP metadata; refusing to load it "
                        "(was the checkpoint tampered with?)")
    return root


def check_resume_files(info: CheckpointInfo) -> dict:
    """trainer.json (returned) and each rng_rank<r>.json, their shape as load_checkpoint reads them:
    one line naming the file, not a rank's traceback (checksums do not stop a hand edit)."""
    fix = "resume another checkpoint"
    trainer = read_json_object(info.path / TRAINER_FILE, "checkpoint file", fix)
    problem = None
    if trainer.get("step") != info.step or isinstance(trainer.get("step"), bool):
        problem = f"step {trainer.get('step')!r}, not the checkpoint's {info.step}"
    elif isinstance(trainer.get("tokens_seen"), bool) or not isinstance(trainer.get("tokens_seen"), int):
        problem = "no whole tokens_seen"
    elif not isinstance(trainer.get("scheduler"), dict) or not isinstance(trainer.get("data"), (dict, type(None))):
        problem = "no scheduler or data state"
    if problem:
        raise UserError(f"checkpoint file {str(info.path / TRAINER_FILE)!r} is malformed ({problem}); {fix}")
    for rng in sorted(info.path.glob("rng_rank*.json")):
        state = read_json_object(rng, "checkpoint file", fix)
        cpu, cuda = state.get("cpu"), state.get("cuda")
        ok = isinstance(cpu, str) and isinstance(cuda, (str, type(None)))
        try:
            ok = ok and all(base64.b64decode(v, validate=True) for v in (cpu, cuda) if v is not None)
        except ValueError:  # binascii.Error
            ok = False
        if not ok:
            raise UserError(f"checkpoint file {str(rng)!r} is malformed (no base64 generator states); {fix}")
    return trainer


# ---------------------------------------------------------------- discovery
@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    world_size: int
    strategy: str
    config_hash: str
    run_id: str = ""  # "" : written before run ids (never pruned by another run)
    saved_at: float = 0.0
    files: dict | None = field(default=None, compare=False)  # {name: [bytes, crc32]}; None: unverifiable


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _count(meta: dict, key: str, low: int) -> int:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{key} is {v!r}, not a whole number >= {low}")
    return v


def _files(files) -> dict | None:
    """{relative name: [bytes, crc32 text]}, each name inside the folder; None: saved before checksums."""
    if files is None:
        return None
    if not isinstance(files, dict):
        raise ValueError("its file list is not a mapping")
    for name, entry in files.items():
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or "\\" in name:
            raise ValueError(f"its file list names {name!r}, outside the checkpoint")
        if (not isinstance(entry, list) or len(entry) != 2 or isinstance(entry[0], bool)
                or not isinstance(entry[0], int) or entry[0] < 0 or not isinstance(entry[1], str)):
            raise ValueError(f"its file list entry for {name!r} is not [bytes, checksum]")
    return files


def _parse_info(path: Path) -> CheckpointInfo | str:
    """The checkpoint's metadata, or why the folder is no usable checkpoint."""
    try:
        meta = json.loads((Path(path) / META_FILE).read_text())
    except FileNotFoundError:
        return f"it has no {META_FILE}"
    except OSError as e:
        return f"its {META_FILE} cannot be read ({e.strerror or type(e).__name__})"
    except ValueError as e:
        return f"its {META_FILE} is not valid JSON ({type(e).__name__})"
    if not isinstance(meta, dict) or meta.get("complete") is not True:
        return f"its {META_FILE} does not say complete: true"
    if not (Path(path) / ".metadata").is_file():
        return "its .metadata is missing"
    try:
        fmt = meta.get("format", FORMAT_VERSION)
        if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt > FORMAT_VERSION:
            raise ValueError(f"format {fmt!r} is not one this shardtune reads (<= {FORMAT_VERSION})")
        for key in ("strategy", "config_hash", "run_id"):
            if key in meta and not isinstance(meta[key], str):
                raise ValueError(f"{key} is {meta[key]!r}, not text")
        saved_at = meta.get("saved_at")
        if saved_at is not None and (isinstance(saved_at, bool) or not isinstance(saved_at, (int, float))
                                     or not math.isfinite(saved_at)):
            raise ValueError(f"saved_at is {saved_at!r}, not a time")
        if meta.get("strategy") not in STRATEGIES:
            raise ValueError(f"strategy {meta.get('strategy')!r} is none of {', '.join(STRATEGIES)}")
        return CheckpointInfo(Path(path), _count(meta, "step", 0), _count(meta, "world_size", 1), meta["strategy"],
                              meta.get("config_hash", ""), meta.get("run_id", ""),
                              float(saved_at or (Path(path) / META_FILE).stat().st_mtime), _files(meta.get("files")))
    except (ValueError, OSError) as e:
        return f"its {META_FILE} is malformed: {e}"


def read_info(path: Path) -> CheckpointInfo | None:
    """The checkpoint's metadata, or None if the folder is not a complete, well-formed checkpoint."""
    info = _parse_info(path)
    return info if isinstance(info, CheckpointInfo) else None


def why_not_checkpoint(path: Path) -> str:
    """Why read_info(path) is None, in words ("" when it is not)."""
    info = _parse_info(path)
    return "" if isinstance(info, CheckpointInfo) else info


def malformed_checkpoints(run_dir: Path) -> list[tuple[Path, str]]:
    """`step_<N>` folders that hold a metadata file but are no usable checkpoint, and why: a start
    must not take them for an empty folder (its save of step N would replace them)."""
    d = checkpoints_dir(run_dir)
    steps = sorted(d.glob("step_*")) if d.is_dir() else []
    return [(p, why) for p in steps if (p / META_FILE).exists() and (why := why_not_checkpoint(p))]


def complete_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """Complete checkpoints of a run, oldest saved first: `step_<N>` folders, and the previous copy
    `.old-step_<N>` of a step whose re-save was cut between its two renames (so no instant exists
    where a step's only copy is invisible)."""
    found: dict[int, CheckpointInfo] = {}
    d = checkpoints_dir(run_dir)
    for p in sorted(d.glob(f"{OLD_PREFIX}step_*")) + sorted(d.glob("step_*")) if d.is_dir() else []:
        info = read_info(p)
        if info is not None and p.name in (f"step_{info.step}", f"{OLD_PREFIX}step_{info.step}"):
            found[info.step] = info  # step_<N> is listed last: it wins over its .old- copy
    return sorted(found.values(), key=lambda i: (i.saved_at, i.step))


def resolve_resume(ckpt_cfg: CheckpointConfig, run_dir: Path) -> CheckpointInfo | None:
    """`checkpoint.resume`: never → None; auto → the newest (last saved) complete checkpoint (or
    None); a path → that checkpoint, which must be complete. Checksums are the ranks' to verify."""
    how = ckpt_cfg.resume
    if how == "never":
        return None
    if how == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    info = _parse_info(Path(how).expanduser())
    if not isinstance(info, CheckpointInfo):
        raise UserError(f"checkpoint.resume {how!r} is not a complete checkpoint ({info}); give a "
                        "checkpoints/step_<N> folder, 'auto' or 'never'")
    return info


def config_hash(cfg: RunConfig) -> str:
    """Hash of what defines the training trajectory (model, data, optim, train): a resume under a
    different value is allowed (e.g. another strategy) but reported."""
    keys = ("model", "data", "optim")
    d = {k: cfg.model_dump(mode="json")[k] for k in keys}
    d["train"] = {k: v for k, v in cfg.train.model_dump(mode="json").items()
                  if k in ("seq_len", "seed", "max_steps", "epochs")}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

def prune(run_dir: Path, keep: int, run_id: str) -> list[int]:
    """Delete all but the newest `keep` complete checkpoints of run `run_id` (a checkpoint of another
    run, or one without a run id, is never touched); each loses its metadata file first (so a
    half-deleted folder never looks complete), then the rest. Returns the steps deleted."""
    own = [i for i in complete_checkpoints(run_dir) if run_id and i.run_id == run_id]
    gone = own[:-keep] if keep > 0 else []
    for info in gone:
        (info.path / META_FILE).unlink(missing_ok=True)
        shutil.rmtree(info.path, ignore_errors=True)
    return [i.step for i in gone]


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep the metrics lines of steps ≤ `last_step` (0: none), so a resumed run never logs a step
    twice; returns the number of lines kept."""
    if not path.is_file():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= last_step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
    return len(kept)


def remove_stale_temporaries(run_dir: Path) -> None:
    """Tidy what killed saves left (rank 0, at start): `.tmp-*` folders are never read and go; an
    `.old-step_<N>` whose `step_<N>` is complete goes; one without (a re-save killed between its two
    renames) is the step's only copy and is renamed back to `step_<N>`, with a line."""
    d = checkpoints_dir(run_dir)
    for p in d.glob(".tmp-step_*") if d.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
    for p in d.glob(f"{OLD_PREFIX}step_*") if d.is_dir() else []:
        final = d / p.name.removeprefix(OLD_PREFIX)
        if read_info(final) is not None or read_info(p) is None:
            shutil.rmtree(p, ignore_errors=True)
        elif not final.exists():
            p.rename(final)
            print(f"shardtune: restored {final} from {p.name} (its re-save was cut between two renames)",
                  file=sys.stderr, flush=True)


def append_event(run_dir: Path, event: dict) -> None:
    """One line in <run_dir>/events.jsonl (resume, save, skipped step, preemption, stop)."""
    with open(Path(run_dir) / "events.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), **event}) + "\n")
