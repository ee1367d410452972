"""A DCP checkpoint's shard files against its `.metadata`, without torch and without reading a
tensor: the launcher's check before any process starts, each rank's before a resume loads, and
export's and generate's. `.metadata` is read only through ckpt_files' allow-list dry run.

Each storage item `.metadata` lists must lie in a file of the checkpoint, within its bytes, and
look like what torch's FileSystemWriter writes (torch 2.13, the default torch_save format, no
stream transforms): one `torch.save` zip archive per item, tensor or not, so b"PK\\x03\\x04" at its
offset and the zip end record b"PK\\x05\\x06" 22 bytes before its end (two 4-byte reads an item).
Found: a shard removed, cut short, or overwritten (zeros or anything else) where an item starts
or ends. Not found: bytes changed inside an item (a tensor's values zeroed, a bit flipped), which
only the checksums see; items written through stream transforms (compression) or in the
safetensors format, which shardtune never writes, are checked for their place in the file only.
"""
from __future__ import annotations

import os
from pathlib import Path

from shardtune.errors import UserError
from shardtune.train.durable import integrity
from shardtune.train.durable.ckpt_files import (
    CheckpointInfo,
    UnreadableMetadata,
    check_metadata_pickle,
    check_resume_files,
)

ZIP_START, ZIP_END, ZIP_END_SIZE = b"PK\x03\x04", b"PK\x05\x06", 22
_STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")


def _entries(folder: Path) -> tuple[dict[str, list[tuple[int, int, bool]]], list[str]]:
    """{file name: [(offset, length, plain torch.save)]} of the items `.metadata` lists, and what is
    wrong with entries that name no file of the folder or hold no whole numbers."""
    root = check_metadata_pickle(folder / ".metadata")  # one line (UserError) for a refused or unreadable pickle
    data = vars(root).get("storage_data")
    if not isinstance(data, dict):
        return {}, [".metadata lists no storage items"]
    files: dict[str, list[tuple[int, int, bool]]] = {}
    bad = []
    for item in data.values():
        state = vars(item) if getattr(type(item), "pickled_as", None) == _STORAGE_INFO else {}
        name, offset, length = state.get("relative_path"), state.get("offset"), state.get("length")
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            bad.append(f".metadata names {name!r}, not a file of the checkpoint")
        elif not all(type(v) is int and v >= 0 for v in (offset, length)):
            bad.append(f".metadata has no whole offset and length for an item of {name}")
        else:
            files.setdefault(name, []).append((offset, length, not state.get("transform_descriptors")))
    return files, bad


def _file_problem(path: Path, items: list[tuple[int, int, bool]]) -> str | None:
    """The first item of `path` that is not there, or not a torch.save archive."""
    if not path.is_file():
        return f"{path.name} is missing (.metadata names it)"
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            for offset, length, plain in sorted(items):
                if offset + length > size:
                    return (f"{path.name} has {size} bytes, but .metadata places data up to byte "
                            f"{offset + length} (cut short?)")
                if plain and (length < ZIP_END_SIZE or os.pread(f.fileno(), 4, offset) != ZIP_START
                              or os.pread(f.fileno(), 4, offset + length - ZIP_END_SIZE) != ZIP_END):
                    return f"{path.name} holds no torch.save archive at byte {offset} (overwritten?)"
    except OSError as e:
        return f"{path.name} cannot be read ({e.strerror or type(e).__name__})"
    return None


def problems(folder: Path, rank: int = 0, world_size: int = 1) -> list[str]:
    """What is wrong with the shard files of `folder` against its `.metadata` ([] if nothing is
    found; one problem per file), for the files this rank checks (integrity.mine: all by default).
    A `.metadata` the allow-list refuses or cannot read is one line (UserError), as everywhere."""
    folder = Path(folder)
    try:
        files, bad = _entries(folder)
    except UnreadableMetadata as e:  # cut short or garbled: damage, the same on every rank
        return [f".metadata is unreadable ({str(e).rsplit('(', 1)[-1].split(')')[0]})"] if rank == 0 else []
    out = bad if rank == 0 else []
    for name in integrity.mine(sorted(files), rank, world_size):
        if (problem := _file_problem(folder / name, files[name])) is not None:
            out.append(problem)
    return out


def damage(info: CheckpointInfo, rank: int = 0, world_size: int = 1, sizes_only: bool = False) -> list[str]:
    """Everything found wrong with this rank's share of a checkpoint: its files against the recorded
    checksums (`sizes_only`: a stat each, the launcher's quick check; none recorded: skipped), then its
    shards against `.metadata`. The one composition every reader uses (export, generate, the launcher,
    the ranks' verify)."""
    bad = []
    if info.files is not None:
        names = integrity.mine(sorted(info.files), rank, world_size)
        bad = integrity.problems(info.path, info.files, names, sizes_only=sizes_only)
        if ".metadata" in info.files and ".metadata" not in names:  # every rank reads it next: every rank checks it
            meta_bad = integrity.problems(info.path, info.files, [".metadata"], sizes_only=sizes_only)
            if meta_bad:  # its owner names it; here only this rank's own problems
                return bad
    return bad or problems(info.path, rank, world_size)


def check_before_launch(info: CheckpointInfo) -> None:
    """A checkpoint to resume by path, before any process starts: `damage` with sizes only, a
    `.metadata` the allow-list accepts, and trainer.json / rng_rank*.json as a resume reads them."""
    bad = damage(info, sizes_only=True)
    if bad:
        more = f" (and {len(bad) - 1} more)" if bad[1:] else ""
        raise UserError(f"checkpoint {info.path} is damaged: {bad[0]}{more}; resume another checkpoint")
    check_resume_files(info)
