"""Checksums of a checkpoint's files, without torch (the launcher may read them): what each rank
wrote is recorded by that rank at save time, in the step's shardtune_checkpoint.json, and checked
again before a resume loads a byte of it.

CRC-32 (zlib): it detects every burst error up to 32 bits and any other change with probability
1 - 2^-32, at 3.9 GiB/s here against SHA-256's 1.3 GiB/s (docs/checkpoints.md, "Verified
checkpoints"). It guards against a disk, a copy or a kill, not an attacker: whoever can rewrite a
shard can rewrite the JSON; code execution is the allow-list unpickler's job (checkpoint.py).
Who hashes what: DCP names rank r's files `__r_<i>.distcp`, and `rng_rank<r>.json` is rank r's;
everything else (.metadata, trainer.json, hf/) is rank 0's. On verify, file owners are taken
modulo the current world size, so every rank reads a share whatever size the job now has.
"""
from __future__ import annotations

import re
import zlib
from pathlib import Path

ALGORITHM = "crc32"
_CHUNK = 8 * 2**20
_OWNER = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng_rank(\d+)\.json)$")


def crc32_file(path: Path) -> str:
    """The file's CRC-32 as 8 hex digits, read in 8 MiB chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def owner(rel_name: str) -> int:
    """The rank that wrote `rel_name` (a path relative to the step folder)."""
    m = _OWNER.match(rel_name)
    return int(m.group(1) or m.group(2)) if m else 0


def listing(folder: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Every file under `folder`, as sorted relative POSIX paths, except `skip`."""
    folder = Path(folder)
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.relative_to(folder).as_posix() not in skip)


def digest(folder: Path, names: list[str]) -> dict[str, list]:
    """{name: [bytes, crc32]} for `names` under `folder`."""
    return {n: [(Path(folder) / n).stat().st_size, crc32_file(Path(folder) / n)] for n in names}


def mine(names, rank: int, world_size: int) -> list[str]:
    """The names this rank hashes (saving: its own files; verifying: owners modulo the world)."""
    return [n for n in names if owner(n) % world_size == rank]


def problems(folder: Path, expected: dict[str, list], names: list[str] | None = None,
             sizes_only: bool = False) -> list[str]:
    """What is wrong with `names` (default: all) against `expected` {name: [bytes, crc32]}: missing,
    another size (truncated, extended) or another checksum (bit flip, overwritten bytes; skipped
    with `sizes_only`: a stat per file, the launcher's quick check)."""
    out = []
    for name in expected if names is None else names:
        try:
            size, crc = expected[name]
        except (TypeError, ValueError):
            out.append(f"{name} has an unreadable checksum entry")
            continue
        path = Path(folder) / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            out.append(f"{name} is not a name inside the checkpoint")
        elif not path.is_file():
            out.append(f"{name} is missing")
        elif path.stat().st_size != size:
            out.append(f"{name} has {path.stat().st_size} bytes, {size} were written")
        elif not sizes_only and crc32_file(path) != crc:
            out.append(f"{name} fails its checksum (its bytes changed since the save)")
    return out
