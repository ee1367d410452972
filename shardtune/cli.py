"""`shardtune` command line: each subcommand parses, calls one function, prints.

Heavy imports (torch, transformers) happen inside the commands that need them, so that
`shardtune plan` answers without importing torch.
"""
from __future__ import annotations

import errno
import importlib
import sys

import typer

from shardtune import __version__
from shardtune.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Plan, run, launch and verify sharded (FSDP2 / ZeRO) fine-tuning of LLMs.",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        print(__version__)
        raise typer.Exit(0)


@app.callback()
def _root(_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                        help="Print shardtune's version and exit.")) -> None:
    """Plan, run, launch and verify sharded (FSDP2 / ZeRO) fine-tuning of LLMs."""


@app.command()
def version() -> None:
    """Print shardtune's version."""
    print(__version__)


# Each area registers its own subcommands (kept in <area>/commands.py, importing no torch at
# module level). Add a module here when an area gains a command.
COMMAND_MODULES: tuple[str, ...] = (
    "shardtune.plan.commands",
    "shardtune.netbench.commands",
    "shardtune.launch.commands",
    "shardtune.train.commands",
    "shardtune.train.export_commands",
    "shardtune.train.generate_commands",
    "shardtune.report.commands",
    "shardtune.recipes.commands",
)


def _conventional_arguments() -> None:
    """Arguments in help as a POSIX usage writes them: `RECIPE [OVERRIDES]...`, listed as `RECIPE`,
    not typer 0.29's `{recipe}` and `recipe <str>` / `<list[str]>` (issue 18 item 7). Three small
    methods of typer's TyperArgument (presentation only; tests/unit/test_cli_vocab.py checks them)."""
    from typer.core import TyperArgument

    def name(arg) -> str:
        return arg.metavar or arg.name.upper()

    def usage(arg) -> str:
        return (name(arg) if arg.required else f"[{name(arg)}]") + ("..." if arg.nargs != 1 else "")

    TyperArgument._usage_display_name = usage
    TyperArgument._rich_display_name = lambda arg: name(arg) + ("..." if arg.nargs != 1 else "")
    TyperArgument.display_type_rich = lambda arg, ctx: None


_conventional_arguments()


def _register_commands() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app)


_register_commands()


PATH_ERRNOS = (errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: a UserError or a usage error is one line on stderr and exit code 2."""
    from shardtune.errors import quiet_library_notices

    quiet_library_notices()
    try:
        rv = app(args=argv, standalone_mode=False, prog_name="shardtune")
    except UserError as e:
        print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    except typer.Abort:
        print("shardtune: aborted", file=sys.stderr)
        return 130
    except typer.Exit as e:
        return e.exit_code
    # a bare group (`shardtune launch`): its help on stdout, exit 0 (typer 0.29 vendors click as typer._click)
    except typer._click.exceptions.NoArgsIsHelpError as e:
        print(e.ctx.get_help())
        return 0
    except typer.TyperException as e:  # usage errors: unknown option, missing argument, bad value
        msg = e.format_message() if hasattr(e, "format_message") else str(e)
        print(f"shardtune: error: {' '.join(msg.split())}", file=sys.stderr)
        return 2
    except OSError as e:
        # a path the user gave that the OS refuses where no command checked it (a name too long, a
        # home folder `~user` that does not exist, ...): its name and the OS's reason, no traceback
        if e.errno not in PATH_ERRNOS:
            raise
        where = f" {e.filename!r}" if e.filename else ""
        print(f"shardtune: error: cannot use{where}: {e.strerror or e}; give another path", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if not str(e).startswith("Could not determine home directory"):  # pathlib's expanduser of `~nosuchuser`
            raise
        print("shardtune: error: a path starts with ~USER for a user this machine does not know; give the full "
              "path", file=sys.stderr)
        return 2
    return rv if isinstance(rv, int) else 0


def console() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console()
