"""Reward functions of `rl.reward` (docs/rl.md): built-ins and the user's own, summed with their weights.

A reward function takes the batch, TRL's convention: fn(prompts, completions, **columns) -> one number a
completion (`columns`: the data's other columns, one value a completion; `completion_ids` too). A user's
reward is code the user asked to run: it is loaded only from the file the recipe names (resolved
against the recipe's folder), never from a model or data folder, and the start-up line says which.
A reward that raises or returns anything but finite numbers is one line naming the rank and the prompt.
Imports no torch.
"""
from __future__ import annotations

import importlib.util
import math
import numbers
import re
from collections.abc import Callable
from pathlib import Path

from shardtune.errors import UserError


def exact_match(column: str) -> Callable:
    def fn(prompts, completions, **columns):
        answers = columns.get(column)
        if answers is None:
            raise UserError(f"reward exact_match: the data has no column {column!r}")
        return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers)]
    return fn


def regex(pattern: str, full: bool) -> Callable:
    rx = re.compile(pattern)

    def fn(prompts, completions, **columns):
        return [float(bool(rx.fullmatch(c.strip()) if full else rx.search(c))) for c in completions]
    return fn


def length(target: int, max_new_tokens: int) -> Callable:
    def fn(prompts, completions, completion_ids, **columns):
        return [1.0 - abs(len(ids) - target) / max_new_tokens for ids in completion_ids]
    return fn


def _inside(path: Path, folder: str | None) -> bool:
    if not folder:
        return False
    try:
        path.resolve().relative_to(Path(folder).expanduser().resolve())
        return True
    except (ValueError, OSError):
        return False


def check_reward_file(spec: str, model_dir: str | None = None, data_path: str | None = None) -> Path:
    """The reward file of 'path/to/file.py:function', checked: it exists and is outside the model and data folders."""
    path = Path(spec.rsplit(":", 1)[0]).expanduser()
    if not path.is_file():
        raise UserError(f"reward file {str(path)!r} (rl.reward {spec!r}) does not exist; relative paths are read "
                        "against the recipe's folder")
    data_dir = data_path if data_path and Path(data_path).expanduser().is_dir() else None  # a dataset folder
    for what, folder in (("model", model_dir), ("data", data_dir)):
        if _inside(path, folder):
            raise UserError(f"reward file {str(path)!r} is inside the {what} folder {folder!r}; a reward is code "
                            "that runs: keep it in your own folder, beside the recipe")
    return path


def load_file_reward(spec: str) -> Callable:
    """fn from 'path/to/file.py:function' (the path as the recipe resolved it), run as the user's code."""
    path, name = spec.rsplit(":", 1)
    module_spec = importlib.util.spec_from_file_location(f"shardtune_reward_{Path(path).stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"reward file {path!r} cannot be loaded as Python")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's code: any error is theirs, said in one line
        raise UserError(f"reward file {path!r} failed to load: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"reward file {path!r} has no function {name!r}")
    return fn


class Rewards:
    """The run's reward functions: `score(...)` gives [per function] lists, `total` their weighted sum."""

    def __init__(self, rl_cfg):
        self.labels = [r.key for r in rl_cfg.reward]
        self.weights = [r.weight for r in rl_cfg.reward]
        self.fns = []
        for r in rl_cfg.reward:
            if r.name == "exact_match":
                self.fns.append(exact_match(r.column))
            elif r.name == "regex":
                self.fns.append(regex(r.pattern, r.full))
            elif r.name == "length":
                self.fns.append(length(r.target, rl_cfg.max_new_tokens))
            else:
                self.fns.append(load_file_reward(r.name))

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list],
              completion_ids: list[list[int]], *, rank: int) -> list[list[float]]:
        """Each function's rewards (one list a function); a raise or a non-number names the rank and prompt."""
        out = []
        for label, fn in zip(self.labels, self.fns):
            try:
                values = fn(prompts, completions, completion_ids=completion_ids, **columns)
            except UserError as e:
                raise UserError(f"rank {rank}: reward {label} on prompt {prompts[0]!r}: {e}") from None
            except Exception as e:  # the user's code
                raise UserError(f"rank {rank}: reward {label} raised {type(e).__name__}: {e} on prompt "
                                f"{prompts[0]!r}") from None
            values = list(values) if isinstance(values, (list, tuple)) else values
            if not isinstance(values, list) or len(values) != len(completions):
                raise UserError(f"rank {rank}: reward {label} returned {type(values).__name__} on prompt "
                                f"{prompts[0]!r}, not a list of {len(completions)} numbers")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                    raise UserError(f"rank {rank}: reward {label} returned {v!r} on prompt {prompts[0]!r}, not a "
                                    "finite number")
            out.append([float(v) for v in values])
        return out

    def total(self, per_fn: list[list[float]]) -> list[float]:
        return [sum(w * vals[i] for w, vals in zip(self.weights, per_fn)) for i in range(len(per_fn[0]))]

    def describe(self) -> str:
        """The start-up line's part: each reward and where a user's is loaded from."""
        return ", ".join(f"{w:g} x {label}" for w, label in zip(self.weights, self.labels))
