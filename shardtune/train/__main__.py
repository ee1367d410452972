"""`python -m shardtune.train RECIPE [flags] [key.path=value ...]`, one process per rank under
torchrun; the flags are config/flags.py's table, as for `shardtune train`.

Bad input: one line on stderr, exit code 2 (no traceback).
"""
from __future__ import annotations

import argparse
import multiprocessing
import signal
import sys
import traceback

from shardtune.config.flags import TRAIN_FLAGS, add_argparse_flags
from shardtune.errors import UserError


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shardtune.train")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="key.path=value")
    add_argparse_flags(p)
    return p.parse_intermixed_args(argv)


def import_rank_side() -> None:
    """Every module `main` imports on its way to the first step, at once: a forking agent
    (train/forked/) calls it, so that the ranks it forks inherit them instead of importing them."""
    import shardtune.train.launcher.preflight  # noqa: F401, PLC0415 main's lazy imports below, all of them
    import shardtune.train.launcher.supervise  # noqa: F401, PLC0415
    import shardtune.train.rank.main  # noqa: F401, PLC0415
    import shardtune.wiring  # noqa: F401, PLC0415


def main(argv: list[str] | None = None) -> int:
    import os

    from shardtune.errors import quiet_library_notices
    from shardtune.train.launcher.preflight import validate_for_launch
    from shardtune.train.launcher.supervise import resolve_config
    from shardtune.wiring import planner  # the trainer imports no planner: it is handed one (docs/DESIGN.md)

    quiet_library_notices()
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.getppid() != 1:  # under torchrun: die with its agent
        from shardtune.train.launcher.agent import die_with_parent

        die_with_parent(os.getppid())
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = resolve_config(args.recipe, args.overrides, **{f.name: getattr(args, f.name) for f in TRAIN_FLAGS})
        world = int(os.environ.get("WORLD_SIZE", 1))
        if os.environ.get("SHARDTUNE_PREFLIGHT") != "done":  # by hand; `shardtune train` checked it already
            validate_for_launch(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), planner=planner())
        from shardtune.train.rank.main import run

        run(cfg, planner=planner())
    except UserError as e:
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's error file: `shardtune train` prints it once
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler

            get_error_handler().record_exception(e)
        launcher = os.environ.get("SHARDTUNE_PREFLIGHT") == "done"
        if not launcher and int(os.environ.get("RANK", "0")) == 0:  # the same error on every rank: print it once
            print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from shardtune.train.durable import faults
        from shardtune.train.durable.resilience import is_peer_failure

        text = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if not is_peer_failure(e):
            faults.record(os.environ.get("RANK", "0"), text)  # the agent's last line names it, if first
            traceback.print_exc()  # on the terminal: a forked rank's raise would reach only torchrun's log
            return 1
        # another rank failed first and its error is the one to read: one line here, no traceback
        print(f"shardtune: rank {os.environ.get('RANK', '?')}: stopped because another rank failed ({text[:200]})",
              file=sys.stderr)
        return faults.PEER_EXIT
    return 0


if __name__ == "__main__":
    from shardtune.processes import exit_now

    forked = multiprocessing.parent_process() is not None  # by torchrun's agent (train/forked/)
    if forked:  # what a fresh interpreter starts with: the agent's stderr is torchrun's log
        sys.stderr = sys.__stderr__  # (train/launcher/agent.py), its signal handlers torchrun's
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    code = main()
    if code or not forked:
        exit_now(code)
    # a rank forked by torchrun (--run-path): it returns, so that torchrun reads its return value;
    # multiprocessing then ends the process without interpreter finalization (as exit_now does)
