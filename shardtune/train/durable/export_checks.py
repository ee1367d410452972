"""`shardtune export`'s OUT_DIR checked as the user typed it, before any checkpoint is read or torch
imported (export.py's `check_out_dir` then checks the folder's contents). Imports no torch."""
from __future__ import annotations

import os
from pathlib import Path

from shardtune.errors import UserError


def check_out_dir_given(out_dir: str) -> None:
    """OUT_DIR before any checkpoint is read: not a file, and it (or the folder it goes in) writable."""
    out = Path(out_dir).expanduser()
    if not out_dir.strip() or any(ord(c) < 32 or ord(c) == 127 for c in out_dir):
        raise UserError(f"OUT_DIR {out_dir!r} is empty or holds a line break or control character; give a plain path")
    if out.is_symlink() and not out.exists():
        raise UserError(f"OUT_DIR {out_dir!r} is a link to nothing (dangling, or a loop); give a folder")
    if out.exists() and not out.is_dir():
        raise UserError(f"OUT_DIR {out_dir!r} is a file, not a folder; give a new or empty folder")
    probe = out if out.is_dir() else next((p for p in out.parents if p.exists()), Path("."))
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"OUT_DIR {out_dir!r} cannot be written ({str(probe)!r} is read-only or not a folder); "
                        "give a folder you can write")
