"""Tokenise once: packed data cached on disk as Arrow IPC files, memory-mapped by every rank.

`data.cache_dir` (default `auto`: the user's cache folder, dataset.resolve_cache_dir): the
folder <cache_dir>/<key> holds tokens.arrow (token ids + target flags, flat), examples.arrow
(example offsets), rows.arrow (each row's examples) and meta.json (the counts and every file's
size and sha256), written last into a temporary folder renamed into
place. The key hashes everything the packing depends on: each data file's path, size and mtime,
the tokenizer (its files, special ids, a probe encoding), template, seq_len, packing, format
options and seed. One process builds while the others wait on a file lock (flock; no collective,
so no collective timeout); later runs and resumes reuse it. A cache whose files do not match
meta.json is named in one line, removed and rebuilt, never trained on.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa

FILES = ("tokens.arrow", "examples.arrow", "rows.arrow", "row_start.arrow")
VERSION = 1


def _files_fingerprint(spec) -> list:
    if spec in (None, "generated"):
        return []
    p = Path(str(spec)).expanduser()
    paths = sorted(glob.glob(str(p))) if any(c in str(spec) for c in "*?[") else [str(p)]
    out = []
    for f in paths:
        fp = Path(f)
        for q in sorted(fp.rglob("*")) if fp.is_dir() else [fp]:
            if q.is_file():
                st = q.stat()
                out.append([str(q.resolve()), st.st_size, st.st_mtime_ns])
    return out or [str(spec)]  # a cached dataset id with no local path: its name


def _tokenizer_fingerprint(tok) -> list:
    folder = Path(str(getattr(getattr(tok, "tok", None), "name_or_path", ""))).expanduser()
    files = []
    if tok.name != "byte" and folder.is_dir():
        for f in sorted(folder.glob("*token*")) + sorted(folder.glob("*.jinja")):
            files.append([f.name, hashlib.sha256(f.read_bytes()).hexdigest()])
    probe = tok.encode("Hello, world! 123 \u00e9\u4e2d")
    return [tok.name, tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.chat_template, probe, files]


def cache_key(data_cfg, seq_len: int, tok, seed: int) -> str:
    """The sha256 (first 24 hex digits) of everything the packed data depends on."""
    opts = {k: getattr(data_cfg, k) for k in ("path", "format", "split", "columns", "template", "packing",
                                                "shuffle", "train_on_inputs", "system_prompt", "generated_examples",
                                                "generated_seed")}
    doc = [VERSION, opts, _files_fingerprint(data_cfg.path), _tokenizer_fingerprint(tok), seq_len, seed]
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_table(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)


def write_cache(folder: Path, data) -> None:
    """PackedData → the cache folder (via a temporary folder renamed into place)."""
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    row_start = np.cumsum([0] + [len(r) for r in data.rows], dtype=np.int64)
    row_examples = np.fromiter((k for r in data.rows for k in r), dtype=np.int32, count=int(row_start[-1]))
    _write_table(tmp / "tokens.arrow", pa.table({"tokens": pa.array(np.asarray(data.tokens, dtype=np.int32)),
                                                 "targets": pa.array(np.asarray(data.targets, dtype=np.uint8))}))
    _write_table(tmp / "examples.arrow", pa.table({"offsets": pa.array(np.asarray(data.offsets, dtype=np.int64))}))
    _write_table(tmp / "rows.arrow", pa.table({"row_examples": pa.array(row_examples)}))
    _write_table(tmp / "row_start.arrow", pa.table({"row_start": pa.array(row_start)}))
    meta = {"version": VERSION, "seq_len": data.seq_len, "num_truncated": data.num_truncated,
            "num_dropped": data.num_dropped, "files": {f: [(tmp / f).stat().st_size, _sha(tmp / f)] for f in FILES}}
    (tmp / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)


def check_cache(folder: Path) -> str | None:
    """None when the cache folder is whole; else what is wrong with it."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        for name, (size, sha) in meta["files"].items():
            f = folder / name
            if not f.is_file() or f.stat().st_size != size or _sha(f) != sha:
                return f"{name} does not match meta.json"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"meta.json unreadable ({type(e).__name__})"
    return None


class MappedRows:
    """rows[i] → the list of example ids of row i, read from the memory-mapped arrays."""

    def __init__(self, start: np.ndarray, examples: np.ndarray):
        self.start, self.examples = start, examples

    def __len__(self) -> int:
        return len(self.start) - 1

    def __getitem__(self, i: int) -> list[int]:
        return self.examples[self.start[i]:self.start[i + 1]].tolist()

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _column(folder: Path, name: str, column: str) -> np.ndarray:
    """A zero-copy numpy view of one primitive column (one record batch, no nulls) of a mapped file.
    Through the buffer, not `to_numpy`, which imports pandas (0.6 s of a start)."""
    reader = pa.ipc.open_file(pa.memory_map(str(folder / name), "r"))
    arr = reader.get_batch(0).column(column)
    return np.frombuffer(arr.buffers()[1], dtype=arr.type.to_pandas_dtype(), count=len(arr), offset=arr.offset *
                         arr.type.bit_width // 8)


def load_cache(folder: Path):
    """The cached PackedData, every array a zero-copy view of the memory-mapped files."""
    from shardtune.train.data.dataset import PackedData  # dataset.py imports this module

    meta = json.loads((folder / "meta.json").read_text())
    rows = MappedRows(_column(folder, "row_start.arrow", "row_start"), _column(folder, "rows.arrow", "row_examples"))
    return PackedData(_column(folder, "tokens.arrow", "tokens"), _column(folder, "tokens.arrow", "targets"),
                      _column(folder, "examples.arrow", "offsets"), rows, meta["seq_len"], meta["num_truncated"],
                      meta["num_dropped"])


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # blocks this process only: no collective to time out
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_packed(cache_dir: str, key: str, build):
    """The packed data of `key` from the cache, built (by `build()`) once under a file lock."""
    root = Path(cache_dir).expanduser()
    folder = root / key
    with _locked(root / f"{key}.lock"):
        problem = check_cache(folder) if folder.exists() else "absent"
        if problem is not None:
            if problem != "absent":
                print(f"shardtune: data cache {str(folder)!r} is corrupt ({problem}); rebuilding it",
                      file=sys.stderr, flush=True)
            write_cache(folder, build())
    return load_cache(folder)
