"""The one exception type a user sees as a one-line message (exit code 2, no traceback)."""


class UserError(ValueError):
    """Bad input the user can fix. The message names the problem and the fix, on one line."""


def suggest(name: str, choices) -> str:
    """' (did you mean X?)' for the closest of `choices`, or '' when none is close."""
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""
