"""The one exception type a user sees as a one-line message (exit code 2, no traceback)."""
from __future__ import annotations

import difflib
import errno
import json
import os
import stat
from pathlib import Path

from shardtune.quiet import quiet_third_party


class UserError(ValueError):
    """Bad input the user can fix. The message names the problem and the fix, on one line."""


def positive_int(value, what: str, key: str) -> int:
    """`value` if it is a positive int (not a bool), else UserError(f"{what} {value!r} is not ... ({key})")."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{what} {value!r} is not a positive integer ({key})")
    return value


def refuse_first(prefix: str, refused) -> None:
    """UserError(f"{prefix} {what}") for the first (bad, what) pair of `refused` whose `bad` holds."""
    what = next((what for bad, what in refused if bad), None)
    if what is not None:
        raise UserError(f"{prefix} {what}")


def suggest(name: str, choices) -> str:
    """' (did you mean X?)' for the closest of `choices`, or '' when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def read_json_object(path, what: str, fix: str) -> dict:
    """The JSON object in `path`; a missing, unreadable, malformed or non-object file is a
    one-line UserError naming `what` and the `fix`."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} {str(p)!r} does not exist; {fix}")
    try:
        obj = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"malformed {what} {str(p)!r}: not valid JSON ({e}); {fix}") from None
    if not isinstance(obj, dict):
        raise UserError(f"malformed {what} {str(p)!r}: not a JSON object; {fix}")
    return obj


def check_no_blocking_pipe(path, option: str) -> None:
    """A named pipe at `path` that nobody reads would block the write forever: one line instead
    (a pipe with a reader, such as /dev/stdout into `less`, is fine)."""
    try:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            return
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise UserError(f"{option} {str(path)!r} is a named pipe nobody reads; give a file path") from None


def quiet_library_notices() -> None:
    """Third-party notices off the user's terminal (shardtune/quiet.py): called by each entry point
    (the CLI, a rank) before heavy imports."""
    quiet_third_party()
