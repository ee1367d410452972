"""A full disk (ENOSPC, EDQUOT) as one line: the folder, the bytes needed (where known) and what is
free. Torch-free: the launcher's start-up writes (run lock, logs/) use it as well as the ranks'
(config.yaml, plan.json, segments/) and the export."""
from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from shardtune.errors import UserError

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FIX = "free space there or use a folder on a larger disk"


def is_disk_full(e: BaseException) -> bool:
    """An OSError with ENOSPC / EDQUOT, or a Rust library's error that carries one (safetensors:
    "Error while serializing: I/O error: No space left on device (os error 28)")."""
    if isinstance(e, OSError):
        return e.errno in FULL_ERRNOS
    return any(f"(os error {n})" in str(e) for n in FULL_ERRNOS)


def _existing(path: Path) -> Path:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path` (or its nearest
    existing parent)."""
    st = os.statvfs(_existing(Path(path)))
    return st.f_bavail * st.f_frsize


def free_text(path: str | Path) -> str:
    st = os.statvfs(_existing(Path(path)))
    return f"{st.f_bavail * st.f_frsize:,} bytes and {st.f_favail:,} inodes free"


def check_room(what: str, path: str | Path, needed: int) -> None:
    """One line before anything is written when `path`'s disk has fewer than `needed` bytes free."""
    free = free_bytes(path)
    if free < needed:
        raise UserError(f"not enough space for {what} in {path}: it needs {needed:,} bytes "
                        f"({needed / 2**30:.2f} GiB), {free:,} are free; {_FIX}")


@contextmanager
def on_full_disk(what: str, path: str | Path, needed: int | None = None,
                 cleanup: Callable[[], None] | None = None) -> Iterator[None]:
    """Inside: ENOSPC / EDQUOT → `cleanup()` (removes what was half-written), then one line naming
    `what`, `path`, the bytes `needed` and the bytes and inodes free afterwards."""
    try:
        yield
    except Exception as e:
        if not is_disk_full(e):
            raise
        if cleanup is not None:
            cleanup()
        need = f"it needs {needed:,} bytes; " if needed else ""
        raise UserError(f"disk full while {what} in {path} ({need}{free_text(path)} after removing what was "
                        f"half-written); {_FIX}") from None


def write_atomic(texts: dict[Path, str]) -> None:
    """Each text into its path, all or none: every one is written to a temporary sibling first, then
    each renamed over its path (a rename needs no space); the temporaries go when a write fails."""
    tmps = {path: path.with_name(f".{path.name}.tmp-{os.getpid()}") for path in texts}
    try:
        for path, text in texts.items():
            tmps[path].write_text(text)
        for path, tmp in tmps.items():
            os.replace(tmp, path)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
