"""Reading a dataset into records: JSON Lines here (file:line errors), everything else through
Hugging Face `datasets` (parquet, CSV, JSON arrays, .arrow, globs, save_to_disk folders, a dataset
id already in the local HF cache, read offline). Each row becomes one normalised record:
{"text"}, {"prompt", "response"} or {"messages"}; Alpaca and ShareGPT rows are mapped onto these,
and `data.columns` renames the dataset's columns first. Imports no torch (the launcher runs it).
"""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from shardtune.errors import UserError

GENERATED = "generated"
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function_call": "assistant", "observation": "tool"}
JSONL = (".jsonl", ".ndjson", "")
BUILDERS = {".parquet": "parquet", ".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
ACCEPTED = "'text', 'prompt'+'response'/'completion', 'messages', Alpaca 'instruction'+'output', ShareGPT " \
           "'conversations', or map your columns with data.columns"


def _detect(obj: dict) -> str:
    if "messages" in obj:
        return "chat"
    if "conversations" in obj:
        return "sharegpt"
    if "instruction" in obj and "output" in obj:
        return "alpaca"
    if "prompt" in obj and ("response" in obj or "completion" in obj):
        return "prompt_response"
    if "text" in obj:
        return "text"
    return ""


def _str(obj: dict, key: str, where: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        raise UserError(f"{where}: {key!r} must be a string")
    return v


def normalize(obj, where: str, want: str, columns: dict[str, str] | None) -> dict:
    """One row → a record; `where` names it (file:line or row) in every error."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}; each line must be an object "
                        f"with {ACCEPTED}")
    if columns:
        obj = {**obj, **{ours: obj[theirs] for ours, theirs in columns.items()}}
    fmt = _detect(obj)
    if not fmt:
        raise UserError(f"{where}: unknown format (keys {sorted(obj)[:8]}); give {ACCEPTED}")
    if want != "auto" and fmt != want:
        raise UserError(f"{where}: is {fmt!r} but data.format={want}; fix the line or set data.format=auto")
    if fmt == "text":
        return {"text": _str(obj, "text", where)}
    if fmt == "prompt_response":
        key = "response" if "response" in obj else "completion"
        return {"prompt": _str(obj, "prompt", where), "response": _str(obj, key, where)}
    if fmt == "alpaca":
        extra = obj.get("input") or ""
        if not isinstance(extra, str):
            raise UserError(f"{where}: 'input' must be a string")
        prompt = _str(obj, "instruction", where) + (f"\n\n{extra}" if extra else "")
        return {"prompt": prompt, "response": _str(obj, "output", where)}
    if fmt == "sharegpt":
        turns = obj["conversations"]
        if not isinstance(turns, list) or not turns:
            raise UserError(f"{where}: 'conversations' must be a non-empty list of {{from, value}}")
        msgs = []
        for t in turns:
            role = SHAREGPT_ROLES.get(t.get("from")) if isinstance(t, dict) else None
            if role is None or not isinstance(t.get("value"), str):
                raise UserError(f"{where}: each ShareGPT turn needs 'from' ({', '.join(SHAREGPT_ROLES)}) and a "
                                "string 'value'")
            msgs.append({"role": role, "content": t["value"]})
        obj = {"messages": msgs}
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    for m in msgs:
        if not (isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ROLES):
            raise UserError(f"{where}: each message needs a 'role' ({', '.join(ROLES)}) and a string 'content'")
    if not any(m["role"] == "assistant" for m in msgs):
        raise UserError(f"{where}: chat example has no assistant turn, so nothing to learn; add one")
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}


def _read_jsonl(path: Path, where: str, data_cfg, norm=normalize) -> list[dict]:
    records = []
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise UserError(f"dataset {where} line {lineno}: not UTF-8 ({e.reason} at byte {e.start + 1} of "
                                    "the line); give UTF-8 text") from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line.rstrip("\r\n"))  # so the column is within the line
                except json.JSONDecodeError as e:
                    raise UserError(f"dataset {where} line {lineno}: malformed JSON ({e.msg} at column {e.colno}); "
                                    "fix or remove the line") from None
                records.append(norm(obj, f"dataset {where} line {lineno}", data_cfg.format, None))
    except OSError as e:
        raise UserError(f"dataset {where} cannot be read: {e.strerror}") from None
    return records


def _load_hf(spec: str, split: str):
    """A `datasets.Dataset` for a file / glob / save_to_disk folder / cached dataset id (offline)."""
    path = Path(spec).expanduser()
    looks_like_path = spec.startswith((".", "/", "~")) or spec.count("/") > 1 or path.suffix.lower() in (
        *BUILDERS, *JSONL[:-1])
    if not path.exists() and looks_like_path and not any(c in spec for c in "*?["):
        raise UserError(f"dataset {spec!r} does not exist; set data.path to a file, a glob, a folder, or a "
                        "dataset id in the local Hugging Face cache")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # never the network at run time
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UserError(f"dataset {spec!r} needs Hugging Face datasets; pip install 'shardtune[data]' (or give a "
                        "JSONL file)") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors become our one line
    files = sorted(glob.glob(str(path))) if any(c in spec for c in "*?[") else [str(path)] if path.is_file() else []
    if not files and any(c in spec for c in "*?["):
        raise UserError(f"dataset glob {spec!r} matches no file; check the pattern")
    try:
        if path.is_dir():
            if not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
                return _folder_split(datasets, str(path), split, spec)  # a folder of data files (a Hub layout)
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise UserError(f"dataset {spec!r} has no split {split!r} (splits: {', '.join(ds)}); set "
                                    "data.split")
                ds = ds[split]
            return ds
        if files:
            kinds = {BUILDERS.get(Path(f).suffix.lower()) for f in files}
            if None in kinds or len(kinds) != 1:
                raise UserError(f"dataset {spec!r}: files must be one of {', '.join(BUILDERS)} (or JSON Lines), "
                                f"all alike; got {sorted({Path(f).suffix for f in files})}")
            kind = kinds.pop()
            if kind == "parquet" and not sum(_parquet_rows(f) for f in files):  # datasets fails on 0 rows
                return []
            return datasets.load_dataset(kind, data_files=files, split="train",
                                         **({"delimiter": "\t"} if files[0].endswith(".tsv") else {}))
        try:
            folder = snapshot_download(spec, repo_type="dataset", local_files_only=True)
        except Exception:  # not in the cache (or not a valid id): nothing to read offline
            raise UserError(f"dataset {spec!r} is not a file and not in the local Hugging Face cache (read offline); "
                            f"download it first: hf download --repo-type dataset {spec}") from None
        return _folder_split(datasets, folder, split, spec)
    except UserError:
        raise
    except Exception as e:  # pyarrow / datasets parse errors: one line naming the dataset
        raise UserError(f"dataset {spec!r} cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                        ) from None


def _parquet_rows(file: str) -> int:
    import pyarrow.parquet as pq  # with datasets

    return pq.ParquetFile(file).metadata.num_rows


def _folder_split(datasets, folder: str, split: str, spec: str):
    try:
        return datasets.load_dataset(folder, split=split)
    except ValueError as e:
        if "split" not in str(e).lower():
            raise
        raise UserError(f"dataset {spec!r} has no split {split!r} ({' '.join(str(e).split())[:160]}); set "
                        "data.split") from None


def read_records(data_cfg, part: str = "train", norm=normalize) -> list[dict]:
    """The dataset's examples as dicts with `text`, or `prompt`+`response`, or `messages`.

    `data_cfg.path` None or 'generated' gives the built-in generated dataset. A missing or empty
    dataset, a row not of a known format, names the file and line (JSONL) or row. With
    `data.val_split`, `part` "train" is the examples not held out, "val" the held-out ones.
    `norm(row, where, format, columns)` makes each row a record (preference pairs: train/data/preference.py).
    """
    records = _read_all(data_cfg, norm)
    fraction = getattr(data_cfg, "val_split", None)
    return hold_out(records, fraction, part, data_cfg.path) if fraction else records


def hold_out(records: list, fraction: float, part: str, where) -> list:
    """The `part` ("train" or "val") of a seeded split that holds out round(fraction × n) examples
    (at least 1, fewer than n), in file order. The seed is fixed: the split depends on the data only."""
    import random

    n = len(records)
    n_val = max(1, round(fraction * n))
    if n_val >= n:
        raise UserError(f"data.val_split {fraction} of dataset {str(where)!r}'s {n} example(s) leaves none to train "
                        "on; give more data or a smaller data.val_split")
    held = set(random.Random(20240917).sample(range(n), n_val))
    return [r for i, r in enumerate(records) if (i in held) == (part == "val")]


def _read_all(data_cfg, norm=normalize) -> list[dict]:
    if data_cfg.path in (None, GENERATED):
        from shardtune.train.data.datagen import generate_examples

        return generate_examples(data_cfg.generated_examples, data_cfg.generated_seed)
    spec = str(data_cfg.path)
    path = Path(spec).expanduser()
    where = repr(spec)
    columns = getattr(data_cfg, "columns", None)
    if path.is_file() and path.suffix.lower() in JSONL and not columns:
        records = _read_jsonl(path, where, data_cfg, norm)
    else:
        ds = _load_hf(spec, getattr(data_cfg, "split", "train"))
        names = list(ds[0]) if isinstance(ds, list) and ds else getattr(ds, "column_names", [])
        missing = sorted(set((columns or {}).values()) - set(names)) if names else []
        if missing:
            raise UserError(f"data.columns names {missing} but dataset {where} has columns {names}; fix "
                            "data.columns")
        records = [norm(row, f"dataset {where} row {i + 1}", data_cfg.format, columns)
                   for i, row in enumerate(ds)]
    if not records:
        raise UserError(f"dataset {where} is empty; give a dataset with at least one example")
    return records


def source_configs(data_cfg) -> list[tuple[object, float]]:
    """(a data config reading one source, its weight) for each of `data.sources`, or [(data_cfg, 1)]."""
    if not getattr(data_cfg, "sources", None):
        return [(data_cfg, 1.0)]
    return [(data_cfg.model_copy(update={"path": s.path, "format": s.format, "split": s.split,
                                         "columns": s.columns, "sources": None}), s.weight)
            for s in data_cfg.sources]
