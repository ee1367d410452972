"""Which files of an export folder are the export's, and putting a new export in place without
touching the others (docs/checkpoints.md "Export"). Imports no torch.

The manifest `.shardtune_export.json` lists each file the export wrote with its size and SHA-256.
A re-export replaces (or removes, an old shard) only files the manifest lists and whose bytes are
unchanged; a file the user added or edited stays as it is and is named in one line (a changed
weights file the new export must write is moved aside in the folder, never deleted). The target is
the folder a link points to: the files go there, the link stays. Files are moved in one by one
from a temporary folder inside the target, the manifest written first as incomplete (naming the
old and new checksums, so an interrupted placement still knows its files) and last as complete.
`verify_weights` is what `shardtune generate` checks before it loads an export.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

from shardtune.errors import UserError

MANIFEST = ".shardtune_export.json"
TMP = ".shardtune-export.tmp"  # the new files, inside the target until they are placed
FORMAT = 2
DATA_SHA256 = "shardtune_data_sha256"  # a safetensors header's record of its tensors' bytes (export.py)
TRUST = "pass --trust-unverified to load it as it is"


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_weights(name: str) -> bool:
    return name.endswith(".safetensors") or name.endswith(".safetensors.index.json")


def target_of(out_dir: Path) -> Path:
    """Where the files go: the folder a link points to (the link stays), else `out_dir`."""
    return out_dir.resolve() if out_dir.is_symlink() else out_dir


def read_manifest(folder: Path) -> dict:
    """{"files": {name: [sha256, ...]}, "complete": bool} of an export folder; an older export's list
    of names counts as unverifiable ([] checksums: ours while present). {} without one."""
    try:
        raw = json.loads((folder / MANIFEST).read_text())
        files = raw["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if isinstance(files, list):
        return {"files": {str(n): [] for n in files}, "complete": True}
    if not isinstance(files, dict):
        return {}
    out = {}
    for name, entry in files.items():
        entry = entry if isinstance(entry, dict) else {}
        out[str(name)] = [h for h in [entry.get("sha256"), *(entry.get("previous") or [])] if isinstance(h, str)]
    return {"files": out, "complete": raw.get("complete", True) is True}


def _present(target: Path) -> list[str]:
    return sorted(p.relative_to(target).as_posix() for p in target.rglob("*")
                  if p.is_file() and p.name != MANIFEST and TMP not in p.relative_to(target).parts)


def _ours(target: Path, name: str, sums: list[str]) -> bool:
    return not sums or sha256_file(target / name) in sums


def _write_manifest(target: Path, files: dict, kept: list[str], complete: bool, mode: int) -> None:
    tmp = target / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format": FORMAT, "checksum": "sha256", "complete": complete, "files": files,
                               "kept": kept}, indent=1))
    os.chmod(tmp, mode)
    os.replace(tmp, target / MANIFEST)


def describe(tmp: Path) -> dict:
    """{name: {"bytes", "sha256"}} of the files a new export wrote into `tmp`."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir())
            if p.is_file() and p.name != MANIFEST}


def place(tmp: Path, target: Path, mode: int) -> list[str]:
    """Move the export in `tmp` (inside `target`) into `target` (module doc); returns the lines said."""
    new = describe(tmp)
    old = read_manifest(target).get("files", {})
    present = _present(target)
    ours = {n for n in present if n in old and _ours(target, n, old[n])}
    theirs = [n for n in present if n not in ours]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # a changed or foreign weights file transformers or PEFT would load beside the new ones: aside
    aside = {n: f"{n}.previous-{stamp}" for n in theirs
             if is_weights(n) and (n in new or n.startswith(("model", "adapter_model")))}
    kept = [n for n in theirs if n in new and n not in aside]
    written = {n: e for n, e in new.items() if n not in kept}
    pending = {n: e | {"previous": old.get(n, [])} for n, e in written.items()}
    pending.update({n: {"sha256": None, "previous": old[n]} for n in ours if n not in written})
    _write_manifest(target, pending, [], complete=False, mode=mode)
    for n, to in aside.items():
        os.replace(target / n, target / to)
    for n in written:
        os.replace(tmp / n, target / n)
    for n in ours - set(written):  # an earlier export's files this one does not write (its old shards)
        (target / n).unlink(missing_ok=True)
    _write_manifest(target, written, sorted(kept), complete=True, mode=mode)
    shutil.rmtree(tmp, ignore_errors=True)
    lines = []
    others = [n for n in theirs if n not in aside]
    if others:
        lines.append(f"{target} holds files this export did not write or that changed since "
                     f"({_names(others)}); kept them as they are" +
                     (f", so the export's own {_names(kept)} was not written" if kept else ""))
    if aside:
        lines.append(f"{_names(list(aside))} in {target} changed since the last export; moved to "
                     f"{_names(list(aside.values()))}")
    for line in lines:
        print(f"shardtune: {line}", file=sys.stderr, flush=True)
    return lines


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def data_sha256(path: Path) -> tuple[str, str] | None:
    """(recorded, actual) SHA-256 of a safetensors file's tensor bytes, name by name, when its header
    records one (DATA_SHA256: an export of ours), else None. Torch-free: the header's offsets."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            recorded = (header.pop("__metadata__", None) or {}).get(DATA_SHA256)
            if not isinstance(recorded, str):
                return None
            h = hashlib.sha256()
            for name in sorted(header):
                begin, end = header[name]["data_offsets"]
                f.seek(8 + size + begin)
                while begin < end:
                    chunk = f.read(min(end - begin, 1 << 24))
                    if not chunk:
                        break
                    h.update(chunk)
                    begin += len(chunk)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return recorded, h.hexdigest()


def verify_weights(folder: Path, trust_unverified: bool = False) -> None:
    """An export's weights files against its manifest's SHA-256, or without a manifest against the
    SHA-256 each safetensors header records (nothing to check in a folder with neither, such as a
    Hub download); one line (UserError) for an altered, missing or half-placed export, or an
    unreadable manifest, unless `trust_unverified`. Config and tokenizer files may be edited."""
    if trust_unverified:
        return
    manifest = read_manifest(folder)
    if not manifest and (folder / MANIFEST).exists():
        raise UserError(f"{folder / MANIFEST} cannot be read as an export manifest, so the weights in {folder} "
                        f"cannot be checked; export it again, or {TRUST}")
    if not manifest:
        for path in sorted(folder.glob("*.safetensors")):
            sums = data_sha256(path)
            if sums is not None and sums[0] != sums[1]:
                raise UserError(f"{path} is not the file the export wrote (the SHA-256 its header records differs) "
                                f"and {folder} has no {MANIFEST}; export it again, or {TRUST}")
        return
    if not manifest["complete"]:
        raise UserError(f"the export in {folder} was interrupted while its files were placed; export it again")
    for name, sums in manifest["files"].items():
        if not is_weights(name) or not sums:
            continue
        path = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not path.is_file():
            raise UserError(f"the export in {folder} lacks {name}, which its {MANIFEST} lists; export it again")
        if sha256_file(path) not in sums:
            raise UserError(f"{path} is not the file the export wrote (its SHA-256 differs from {MANIFEST}); "
                            f"export it again, or {TRUST}")
