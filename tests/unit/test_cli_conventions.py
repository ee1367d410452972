"""A conventional CLI (issue 18 item 7): bare groups print help and exit 0; -h and --version."""
from __future__ import annotations

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
