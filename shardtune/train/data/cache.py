"""Tokenise once: packed data cached on disk as Arrow IPC files, memory-mapped by every rank.

`data.cache_dir` (default `auto`: the user's cache folder, dataset.resolve_cache_dir): the
folder <cache_dir>/<key> holds tokens.arrow (token ids + target flags, flat), examples.arrow
(example offsets), rows.arrow (each row's examples) and meta.json (the counts and every file's
size and sha256), written last into a temporary folder renamed into
place. The key hashes everything the packing depends on: each data file's path, size and mtime,
the tokenizer (its files, special ids, a probe encoding), template, seq_len, packing, format
options and seed. One process builds while the others wait on a file lock (flock; no collective,
so no collective timeout); later runs and resumes reuse it.

Nothing is trusted by its folder name: meta.json records the key and every input it hashes, and a
load checks them against this run's (`verify_entry`, for any content-keyed cache: the DPO
reference log-prob cache too), each file against its size and sha256, and every token id below
the tokenizer's vocabulary. An entry that fails (two entries swapped, another tokenizer's entry
copied under this key, meta.json edited by hand, a cut file) is named in one line and rebuilt,
never trained on.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from shardtune.train.data.packing import PackedData

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


def _plain(obj) -> dict:
    """`obj` as JSON reads it back (tuples as lists, paths as text): comparable with a meta.json."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def cache_inputs(data_cfg, seq_len: int, tok, seed: int) -> dict:
    """Everything the packed data depends on, as recorded in meta.json and compared at load."""
    opts = {k: getattr(data_cfg, k) for k in ("path", "format", "split", "columns", "template", "packing",
                                                "shuffle", "train_on_inputs", "system_prompt", "generated_examples",
                                                "generated_seed")}
    if getattr(data_cfg, "val_split", None):  # only when set: the keys of earlier caches stay valid
        opts["val_split"] = data_cfg.val_split
    return _plain({"version": VERSION, "format options": opts, "data files": _files_fingerprint(data_cfg.path),
                   "tokenizer": _tokenizer_fingerprint(tok), "seq_len": seq_len, "seed": seed})


def key_of(inputs: dict) -> str:
    """The sha256 (first 24 hex digits) of a cache entry's inputs: its folder name."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:24]


def cache_key(data_cfg, seq_len: int, tok, seed: int) -> str:
    """The key (folder name) of this data's packed cache."""
    return key_of(cache_inputs(data_cfg, seq_len, tok, seed))


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_table(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)


def place_entry(folder: Path, fill) -> None:
    """A cache entry built by `fill(tmp)` in a temporary folder beside it, then renamed into place.
    An entry that is a link is followed: its target is replaced, the link stays (a rename onto the
    link raised NotADirectoryError and left the temporary). No temporary is left on failure; a
    folder that cannot be written is one line."""
    dest = Path(os.path.realpath(folder)) if folder.is_symlink() else folder
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        fill(tmp)
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise
        from shardtune.errors import UserError

        raise UserError(f"cache entry {str(folder)!r} cannot be written ({e.strerror or e}); give data.cache_dir "
                        "a writable folder (or null)") from None


def write_cache(folder: Path, data, inputs: dict | None = None) -> None:
    """PackedData → the cache folder (place_entry); meta.json records the key (the folder's name)
    and `inputs`, the vocabulary bound checked at load."""
    place_entry(folder, lambda tmp: _fill_cache(tmp, folder.name, data, inputs))


def _fill_cache(tmp: Path, key: str, data, inputs: dict | None) -> None:
    row_start = np.cumsum([0] + [len(r) for r in data.rows], dtype=np.int64)
    row_examples = np.fromiter((k for r in data.rows for k in r), dtype=np.int32, count=int(row_start[-1]))
    _write_table(tmp / "tokens.arrow", pa.table({"tokens": pa.array(np.asarray(data.tokens, dtype=np.int32)),
                                                 "targets": pa.array(np.asarray(data.targets, dtype=np.uint8))}))
    _write_table(tmp / "examples.arrow", pa.table({"offsets": pa.array(np.asarray(data.offsets, dtype=np.int64))}))
    _write_table(tmp / "rows.arrow", pa.table({"row_examples": pa.array(row_examples)}))
    _write_table(tmp / "row_start.arrow", pa.table({"row_start": pa.array(row_start)}))
    meta = {"version": VERSION, "key": key, "inputs": inputs, "seq_len": data.seq_len,
            "num_truncated": data.num_truncated, "num_dropped": data.num_dropped,
            "files": {f: [(tmp / f).stat().st_size, _sha(tmp / f)] for f in FILES}}
    (tmp / "meta.json").write_text(json.dumps(meta))


def verify_entry(folder: Path, key: str, inputs: dict | None) -> str | None:
    """None when the cache entry `folder` was built from exactly `inputs` under `key` (meta.json's
    own record, not the folder's name) and each file listed in meta.json has its recorded size and
    sha256; else what is wrong, in words. Any content-keyed cache calls it (the data cache here, a
    DPO reference log-prob cache)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"meta.json unreadable ({type(e).__name__})"
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) or not meta["files"]:
        return "meta.json lists no files"
    if meta.get("key") != key:
        return f"meta.json records key {str(meta.get('key'))[:24]!r}, not its folder's"
    if inputs is not None and meta.get("inputs") != inputs:
        saved = meta.get("inputs") if isinstance(meta.get("inputs"), dict) else {}
        differ = [k for k in dict.fromkeys([*inputs, *saved]) if saved.get(k) != inputs.get(k)]
        return f"it was built from other inputs ({', '.join(differ[:4])} differ)"
    for name, entry in meta["files"].items():
        f = folder / str(name)
        if not (isinstance(entry, list) and len(entry) == 2) or Path(str(name)).name != name:
            return f"meta.json's entry for {name!r} is malformed"
        if not f.is_file() or f.stat().st_size != entry[0] or _sha(f) != entry[1]:
            return f"{name} does not match meta.json"
    return None


def check_cache(folder: Path, inputs: dict | None = None, vocab_size: int | None = None) -> str | None:
    """None when the data cache folder is whole, of `inputs` and every token id in [0, vocab_size);
    else what is wrong with it."""
    problem = verify_entry(folder, folder.name, inputs)
    if problem is not None:
        return problem
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if set(meta["files"]) != set(FILES):
            return "meta.json lists other files than a data cache's"
        for k in ("seq_len", "num_truncated", "num_dropped"):
            if isinstance(meta.get(k), bool) or not isinstance(meta.get(k), int) or meta[k] < 0:
                return f"meta.json's {k} is {meta.get(k)!r}, not a count"
        if inputs is not None and "seq_len" in inputs and meta["seq_len"] != inputs["seq_len"]:
            return f"meta.json's seq_len {meta['seq_len']} is not the run's {inputs.get('seq_len')}"
        tokens = _column(folder, "tokens.arrow", "tokens")
    except (OSError, ValueError, KeyError, TypeError, IndexError, pa.ArrowException) as e:
        return f"its files are unreadable ({type(e).__name__})"
    if vocab_size is not None and len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        return f"it holds token id {int(tokens.max())}, outside the tokenizer's {vocab_size} ids"
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
    meta = json.loads((folder / "meta.json").read_text())
    rows = MappedRows(_column(folder, "row_start.arrow", "row_start"), _column(folder, "rows.arrow", "row_examples"))
    return PackedData(_column(folder, "tokens.arrow", "tokens"), _column(folder, "tokens.arrow", "targets"),
                      _column(folder, "examples.arrow", "offsets"), rows, meta["seq_len"], meta["num_truncated"],
                      meta["num_dropped"])


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # blocks this process only: no collective to time out
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_packed(cache_dir: str, key: str, build, inputs: dict | None = None, vocab_size: int | None = None):
    """The packed data of `key` from the cache, built (by `build()`) once under a file lock. An
    entry that is not whole, not of `inputs` or holds ids outside the vocabulary: one line, rebuilt."""
    root = Path(cache_dir).expanduser()
    folder = root / key
    if root.exists() and not root.is_dir():
        from shardtune.errors import UserError

        raise UserError(f"data.cache_dir {str(root)!r} is a file, not a folder; give a folder (or null to "
                        "tokenise in memory)")
    try:
        lock = _locked(root / f"{key}.lock")
        lock.__enter__()
    except OSError as e:
        from shardtune.errors import UserError

        raise UserError(f"data.cache_dir {str(root)!r} cannot be used ({e.strerror or type(e).__name__}); give a "
                        "writable folder (or null to tokenise in memory)") from None
    with contextlib.ExitStack() as stack:
        stack.push(lock)
        problem = check_cache(folder, inputs, vocab_size) if folder.exists() else "absent"
        if problem is not None:
            if problem != "absent":
                print(f"shardtune: data cache {str(folder)!r} is not this data's ({problem}); rebuilding it",
                      file=sys.stderr, flush=True)
            write_cache(folder, build(), inputs)
            problem = check_cache(folder, inputs, vocab_size)
            if problem is not None:
                from shardtune.errors import UserError

                raise UserError(f"data cache {str(folder)!r} does not verify right after it was built ({problem}); "
                                "the tokenizer produced ids outside its vocabulary, or the disk changed the files")
    return load_cache(folder)
