"""`shardtune` command line: each subcommand parses, calls one function, prints.

Heavy imports (torch, transformers) happen inside the commands that need them, so that
`shardtune plan` answers without importing torch.
"""
from __future__ import annotations

import sys

import typer

from shardtune.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Plan, run, launch and verify sharded (FSDP2 / ZeRO) fine-tuning of LLMs.",
)


# --- subcommands register below; each keeps to a few lines and calls into its module ---------


def main(argv: list[str] | None = None) -> int:
    """Console entry point: a UserError or a usage error is one line on stderr and exit code 2."""
    import click

    try:
        app(args=argv, standalone_mode=False)
    except UserError as e:
        print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    except click.exceptions.Abort:
        print("shardtune: aborted", file=sys.stderr)
        return 130
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:  # usage errors: unknown option, missing argument, bad value
        print(f"shardtune: error: {e.format_message()}", file=sys.stderr)
        return 2
    return 0


def console() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console()
