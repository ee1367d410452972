"""DCP checkpoint → Hugging Face folder (config.json, safetensors shards + index, tokenizer files),
streamed: host memory stays bounded by one output shard (or the largest single tensor), never
the whole model.

How: the DCP `.metadata` lists every saved tensor with its shape and dtype. The model's tensors are
grouped into shards of at most `max_shard_bytes` (HF's rule: a tensor larger than that is a shard
of its own), then each shard's tensors are allocated and read with `dcp.load(no_dist=True)`,
which reads only their byte ranges from the `.distcp` files (whatever world size or strategy
wrote them), written with safetensors, and freed. No process group is needed, and none is used
when one exists (export at the end of training runs on rank 0 alone).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import safetensors.torch
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig

from shardtune.errors import UserError, read_json_object
from shardtune.train.core import lora as lora_mod
from shardtune.train.core.hub_layout import saved_names, stores_saved_names
from shardtune.train.core.lora_base import adapter_targets, base_tensors
from shardtune.train.durable import integrity
from shardtune.train.durable.checkpoint import SafeFileSystemReader, safe_dcp_load
from shardtune.train.durable.ckpt_files import HF_DIR, read_info, why_not_checkpoint
from shardtune.train.durable.diskfull import check_room, is_disk_full, on_full_disk
from shardtune.train.durable.export_files import DATA_SHA256, MANIFEST, TMP, place, target_of
from shardtune.train.durable.shards import damage

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # HF's default max_shard_size "5GB" (10^9 bytes)
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "module.")
# a source model folder's files an export carries over as they are (tokenizer, special tokens, chat
# templates, generation settings such as Llama-3-Instruct's stop tokens); config.json is the run's
# in a checkpoint's hf/: the source folder stored the Hub's names (per-expert MoE tensors), so the
# export writes them (transformers' own save conversion, train/core/hub_layout.py `saved_names`)
SAVED_NAMES = "shardtune_saved_names.json"
SOURCE_FILES = ("generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
                "chat_template*", "vocab*", "merges*", "*.model", "*.tiktoken", "spiece*")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_size_bytes(text: str | int) -> int:
    """'5GB' → 5·10^9, '500MB' → 5·10^8, '2GiB' → 2·2^30, '1000' → 1000 bytes (HF's units:
    KB/MB/GB are powers of 10, KiB/MiB/GiB powers of 2)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise UserError(f"size {text!r} is not understood; write e.g. 5GB, 500MB, 2GiB or a byte count")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    value = float(m.group(1)) * scale
    if not value < 2**63:  # inf too: no shard is that large
        raise UserError(f"size {text!r} is beyond any file; write e.g. 5GB")
    size = int(value)
    if size < 1:
        raise UserError(f"size {text!r} must be at least one byte")
    return size


def check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in _DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose fp32, bf16 or fp16")


def stored_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """The one dtype an export stores without `--dtype`: the checkpoint's, or its widest when it
    mixes float dtypes (a LoRA's fp32 adapters merged into a bf16 base stay bf16: W's dtype)."""
    floats = set(dtypes)
    return floats.pop() if len(floats) == 1 else max(floats, key=lambda d: d.itemsize)


def hf_name(dcp_key: str) -> str:
    """'model.model.layers.0.mlp.up_proj.weight' (DCP key) → 'model.layers.0.mlp.up_proj.weight':
    drop the state-dict section and any wrapper module names."""
    name = dcp_key.removeprefix("model.")
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def model_tensors(ckpt: Path) -> list[tuple[str, str, torch.Size, torch.dtype]]:
    """(DCP key, HF name, shape, dtype) of every model tensor in the checkpoint, in saved order."""
    md = SafeFileSystemReader(ckpt).read_metadata()
    return [(k, hf_name(k), v.size, v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)]


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Greedy, in order: start a new shard when the next tensor would pass the limit (HF's
    `shard_checkpoint` rule; a tensor over the limit gets a shard alone)."""
    shards: list[list[str]] = []
    current, current_bytes = [], 0
    for name, nbytes in sizes:
        if current and current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += nbytes
    if current:
        shards.append(current)
    return shards


def copy_source_files(src: str | Path, dest: Path, tokenizer: bool = True) -> list[str]:
    """The source model folder's SOURCE_FILES (without tokenizer files when `tokenizer` is False)
    copied into `dest` as files; returns their names. Nothing when `src` is no folder."""
    src = Path(src).expanduser()
    names = sorted({p.name for pat in SOURCE_FILES for p in src.glob(pat) if p.is_file()} if src.is_dir() else [])
    names = [n for n in names if tokenizer or n == "generation_config.json"]
    for name in names:
        shutil.copyfile(src / name, dest / name)
    weights = sorted(src.glob("*.safetensors")) if src.is_dir() else []
    if weights and (dest / "config.json").is_file():  # the source's names, for the export (SAVED_NAMES)
        on_disk: set[str] = set()
        for f in weights:
            with safetensors.safe_open(str(f), framework="pt") as h:
                on_disk.update(h.keys())
        if stores_saved_names(AutoConfig.from_pretrained(dest), on_disk):
            (dest / SAVED_NAMES).write_text(json.dumps({"names": "transformers save_pretrained"}) + "\n")
    return names


def _file_mode() -> int:
    """0666 less the process umask: the mode any file the user creates gets (0644 under umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """One line for an output that cannot be an export: a file, a non-empty folder (unless
    `overwrite`), a place that cannot be written (read-only folder or file system)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"export folder {out_dir} is a file; give a new or empty folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite and not (out_dir / MANIFEST).is_file():
        raise UserError(f"output folder {out_dir} is not empty; give a new or empty folder (or an earlier export)")
    parent = out_dir.parent
    while not parent.exists():
        parent = parent.parent
    for where in (out_dir, parent) if out_dir.is_dir() else (parent,):
        if not os.access(where, os.W_OK | os.X_OK):
            raise UserError(f"export folder {out_dir} cannot be written ({where} is read-only); give another folder")


def export_checkpoint(ckpt: str | Path, out_dir: str | Path,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: str | None = None,
                      overwrite: bool = False, adapter_only: bool = False) -> Path:
    """Write an HF folder from a complete, verified shardtune checkpoint; returns `out_dir`. Peak host
    memory: one shard's tensors. `dtype` (fp32 | bf16 | fp16) casts on the way out; None keeps the
    checkpoint's one, and config.json says it. The files are written into a temporary folder, then
    placed (export_files.py: only the export's own files are replaced, a link's target gets them,
    the manifest records their SHA-256); `overwrite` allows a non-empty `out_dir` that is no
    earlier export (training's end-of-run export). Files are 0666 less the umask, as the user's own.
    LoRA checkpoints (train/core/lora.py): each target weight is merged, W + (alpha/r)·B A, as its shard
    streams (its A and B are read with it); `adapter_only` writes a PEFT adapter folder instead
    (adapter_config.json + adapter_model.safetensors, for `PeftModel.from_pretrained`)."""
    ckpt, out_dir = Path(ckpt).expanduser(), Path(out_dir).expanduser()
    info = read_info(ckpt)
    if info is None:
        raise UserError(f"{ckpt} is not a complete shardtune checkpoint ({why_not_checkpoint(ckpt)}); give a "
                        "<run>/checkpoints/step_<N> folder")
    bad = damage(info)
    if bad:
        raise UserError(f"checkpoint {ckpt} is damaged: {bad[0]}" + (f" (and {len(bad) - 1} more)" if bad[1:] else ""))
    if not (ckpt / HF_DIR / "config.json").is_file():
        raise UserError(f"{ckpt} has no {HF_DIR}/config.json; it was not written by shardtune train")
    check_dtype(dtype)
    out_dir = target_of(out_dir)  # a link to a folder: the files go where it points
    if out_dir.resolve() == ckpt.resolve() or ckpt.resolve() in out_dir.resolve().parents:
        raise UserError(f"export folder {out_dir} is inside the checkpoint {ckpt}; give a folder outside it")
    check_out_dir(out_dir, overwrite)
    out_dtype = _DTYPES[dtype] if dtype else None
    entries = model_tensors(ckpt)
    hf_config = read_json_object(ckpt / HF_DIR / "config.json", "checkpoint file", "export another checkpoint")
    lora = hf_config.get(lora_mod.CONFIG_KEY)
    if adapter_only and not lora:
        raise UserError(f"{ckpt} was not trained with LoRA (lora.rank > 0); drop --adapter-only")
    entries, adapters = (lora_mod.split_adapters(entries, adapter_targets(lora, ckpt / HF_DIR)) if lora
                         else (entries, {}))
    # a LoRA checkpoint holds the adapters and what else was trained, not the frozen base
    # (train/durable/checkpoint.py): a merged export rebuilds every tensor it lacks from the base
    # pointer, one at a time (key "base:<name>", never a DCP key)
    saved = {name for _, name, _, _ in entries}
    base = {} if adapter_only or not lora else {
        f"base:{name}": (shape, dt, read)
        for name, (shape, dt, read) in base_tensors(lora, ckpt / HF_DIR).items() if name not in saved}
    entries += [(k, k.removeprefix("base:"), shape, dt) for k, (shape, dt, _) in base.items()]
    if adapter_only:
        entries = [a for pair in adapters.values() for a in pair.values()]
        entries = [(k, lora_mod.peft_saved_name(name), shape, dt) for k, name, shape, dt in entries]
    names = {name for _, name, _, _ in entries}
    if hf_config.get("tie_word_embeddings") and {"lm_head.weight", "model.embed_tokens.weight"} <= names:
        # tied: HF saves the embedding once and ties lm_head to it when loading
        entries = [e for e in entries if e[1] != "lm_head.weight"]
    if not entries:
        raise UserError(f"{ckpt} holds no model tensors")
    if out_dtype is None and not adapter_only:  # config.json says the dtype every tensor is stored in
        out_dtype = stored_dtype([dt for *_, dt in entries])
    elem = lambda dt: torch.empty((), dtype=out_dtype or dt).element_size()  # noqa: E731
    sizes = [(k, shape.numel() * elem(dt)) for k, _, shape, dt in entries]
    # adapters are small (r × (in + out) per target) and PEFT reads one file: never split them
    shards = [[k for k, _ in sizes]] if adapter_only else plan_shards(sizes, max_shard_bytes)
    meta = {k: (name, shape, dt) for k, name, shape, dt in entries}
    merge = {} if adapter_only else adapters
    meta.update({e[0]: (e[1], e[2], e[3]) for pair in merge.values() for e in pair.values()})

    # written whole into a temporary folder inside OUT before any file there changes: both must fit
    tmp, created = out_dir / TMP, not out_dir.exists()

    def cleanup() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)

    needed = sum(n for _, n in sizes) + sum(f.stat().st_size for f in (ckpt / HF_DIR).iterdir() if f.is_file())
    check_room("the export", out_dir, needed)
    with on_full_disk("writing the export", out_dir, needed, cleanup=cleanup):
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # an interrupted export's leftover
            tmp.mkdir(parents=True)
        except OSError as e:
            if is_disk_full(e):
                raise
            cleanup()
            raise UserError(f"export folder {out_dir} cannot be written ({e.strerror or e}); "
                            "give another folder") from None
        try:
            _write_export(ckpt, tmp, entries, shards, meta, merge, base, out_dtype, lora, hf_config, adapter_only)
        except BaseException:
            cleanup()
            raise
    try:
        place(tmp, out_dir, _file_mode())
    except OSError as e:  # OUT changed under us (a mount gone read-only): the manifest says what was placed
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"export folder {out_dir} cannot be written ({e.strerror or e}); "
                        "give another folder") from None
    return out_dir


def _sort_metadata(path: Path, metadata: dict) -> None:
    """safetensors writes its metadata in a hash map's order, which changes between processes: the
    same keys in sorted order, of the same length, in place, so an export is byte for byte the same."""
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = f.read(size)
        want = json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()
        for order in (metadata, dict(reversed(metadata.items()))):
            got = json.dumps(order, separators=(",", ":")).encode()
            if got in header:
                f.seek(8)
                f.write(header.replace(got, want, 1))
                return


def _write_export(ckpt, tmp, entries, shards, meta, merge, base, out_dtype, lora, hf_config, adapter_only) -> None:
    """The export's files into `tmp` (export_checkpoint's body once the plan is made)."""
    reader = SafeFileSystemReader(ckpt)
    hub_config = None
    if (ckpt / HF_DIR / SAVED_NAMES).is_file() and not adapter_only:
        hub_config = AutoConfig.from_pretrained(ckpt / HF_DIR)
    weight_map: dict[str, str] = {}
    total = 0
    for i, keys in enumerate(shards, start=1):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        if adapter_only:
            fname = "adapter_model.safetensors"
        # a LoRA target weight is read with its A and B (r × (in + out) more elements) and merged
        extra = [e[0] for k in keys for e in merge.get(meta[k][0], {}).values()]
        want = {k: torch.empty(meta[k][1], dtype=meta[k][2]) for k in [*keys, *extra] if k not in base}
        if want:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
                warnings.simplefilter("ignore", UserWarning)
                safe_dcp_load(want, reader, no_dist=True)
        want.update({k: base[k][2]() for k in keys if k in base})
        for k in keys:
            if meta[k][0] in merge:
                pair = merge[meta[k][0]]
                want[k] = lora_mod.merged_weight(want[k], want[pair["A"][0]], want[pair["B"][0]],
                                                 lora_mod.scaling(lora))
        tensors = {meta[k][0]: (want[k].to(out_dtype) if out_dtype else want[k]).contiguous() for k in keys}
        del want
        if hub_config is not None:  # the source folder's names: per-expert tensors split as it stored them
            tensors = {k: v.contiguous() for k, v in saved_names(hub_config, tensors).items()}
        data = hashlib.sha256()  # the tensors' bytes, name by name: checked by generate without a manifest
        for name in sorted(tensors):
            data.update(tensors[name].reshape(-1).view(torch.uint8).numpy())
        metadata = {"format": "pt", DATA_SHA256: data.hexdigest()}
        safetensors.torch.save_file(tensors, str(tmp / fname), metadata=metadata)
        _sort_metadata(tmp / fname, metadata)
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del tensors
    if len(shards) > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    if adapter_only:
        lora_mod.write_adapter_config(lora, hf_config.get("_name_or_path") or "", tmp)
    else:
        for f in (ckpt / HF_DIR).iterdir():  # config.json, tokenizer files
            if f.is_file() and f.name != SAVED_NAMES:
                shutil.copy2(f, tmp / f.name)
    if lora and not adapter_only:  # merged: a plain HF model, without our adapter settings
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop(lora_mod.CONFIG_KEY, None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    if not adapter_only:  # from_pretrained loads in the config's dtype: it must be the files' one
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["dtype"] = cfg["torch_dtype"] = str(out_dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    mode = _file_mode()
    for name in integrity.listing(tmp):  # safetensors writes 0600; an export is as readable as any user file
        os.chmod(tmp / name, mode)
