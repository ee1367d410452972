"""A conventional CLI (issue 18 item 7): bare groups print help and exit 0; -h and --version."""
from __future__ import annotations

import re

import pytest

from shardtune import __version__
from shardtune.cli import main


@pytest.mark.parametrize("argv,usage", [
    ([], "Usage: shardtune [OPTIONS] COMMAND"),
    (["launch"], "Usage: shardtune launch [OPTIONS] COMMAND"),
    (["bench"], "Usage: shardtune bench [OPTIONS] COMMAND"),
])
def test_bare_group_prints_its_help_on_several_lines_and_exits_0(argv, usage, capsys):
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith(usage)
    assert len(out.splitlines()) > 5  # the help as help, not squashed into one error line


@pytest.mark.parametrize("argv", [["-h"], ["plan", "-h"], ["launch", "slurm", "-h"], ["train", "--help"]])
def test_short_help_flag(argv, capsys):
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("Usage: shardtune")


def test_version_flag(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == __version__


def test_a_real_usage_error_still_exits_2(capsys):
    assert main(["plan", "--no-such-flag"]) == 2
    assert "No such option" in capsys.readouterr().err


def test_plan_help_lists_choices_and_real_metavars(capsys):
    assert main(["plan", "-h"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for choice in ("--precision [bf16-mixed|bf16|fp32]", "--offload [none|optimizer|all]",
                   "--strategy [ddp|zero1|zero2|zero3|hsdp]", "--gpus N"):
        assert choice in out
    options = out[out.index("Options:"):]
    assert "<str>" not in options and "<int>" not in options and "<float>" not in options


def _leaf_commands():
    """(argv, click command) for every subcommand, groups walked (the help a user reaches)."""
    import typer

    from shardtune.cli import app

    out, todo = [], [([], typer.main.get_command(app))]
    while todo:
        argv, cmd = todo.pop()
        subs = getattr(cmd, "commands", None)
        if subs:
            todo += [([*argv, name], sub) for name, sub in subs.items()]
        else:
            out.append((argv, cmd))
    return sorted(out, key=lambda x: x[0])


LEAVES = _leaf_commands()
# A metavar is a placeholder a user reads as a kind of value (N, DIR, FILE, HOST:PORT, ...), or
# the fixed choices in brackets; never typer's type placeholders (<int>, <str>, <float>, <list[str]>).
METAVAR = re.compile(r"^([A-Z][A-Z0-9_]*([:][A-Z][A-Z0-9_]*)?|\[[a-z0-9.\-]+(\|[a-z0-9.\-]+)+\])$")


def test_every_subcommand_is_walked():
    names = {" ".join(argv) for argv, _ in LEAVES}
    assert {"plan", "train", "export", "report", "generate", "doctor", "bench comm", "launch slurm",
            "launch k8s", "launch torchrun"} <= names


@pytest.mark.parametrize("argv,cmd", LEAVES, ids=[" ".join(a) for a, _ in LEAVES])
def test_every_option_has_help_and_a_real_metavar_or_its_choices(argv, cmd, capsys):
    import click

    assert main([*argv, "-h"]) == 0
    shown = capsys.readouterr().out
    assert not re.search(r"<(int|str|float|bool|path|list\[\w+\])>|\{\w+\}", shown), shown  # typer's placeholders
    for p in cmd.params:
        if not isinstance(p, click.Option) or p.hidden:
            continue
        assert (p.help or "").strip(), f"{' '.join(argv)} {p.opts[0]}: no help text"
        if p.is_flag or p.count:
            continue
        with click.Context(cmd, info_name=" ".join(["shardtune", *argv])) as ctx:
            record = p.get_help_record(ctx)[0]  # e.g. "--nproc N" or "-o, --output FILE"
        metavar = record.split(" ", record.count(" "))[-1] if " " in record else ""
        assert METAVAR.match(metavar), f"{' '.join(argv)}: {record!r}"
        assert record in " ".join(shown.split()), record
