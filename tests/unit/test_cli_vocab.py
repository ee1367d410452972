"""One vocabulary across the CLI (issue 18 item 7): `launch --interconnect` takes the names `plan`
takes (the catalogue's links and aliases; catalog/interconnects.py is the reference), and the
train flags show their allowed values and real metavars, in typer's and argparse's help alike."""
from __future__ import annotations

import re

import pytest

from shardtune.catalog.interconnects import ALIASES, INTERCONNECTS, get_interconnect
from shardtune.cli import main
from shardtune.config.flags import TRAIN_FLAGS
from shardtune.launch.checks import resolve_interconnect
from shardtune.launch.network import env_dict, preset
from shardtune.strategies import PRECISIONS, STRATEGIES
from shardtune.train.__main__ import parse_args

INTER = [n for n, v in INTERCONNECTS.items() if v.scope == "inter"]
INTER_ALIASES = [a for a, n in ALIASES.items() if INTERCONNECTS[n].scope == "inter"]
# the transport each catalogue link runs on, by what the catalogue says it is (its source text)
TRANSPORT = {"ib-ndr-400": "ib", "ib-hdr-200": "ib", "roce-400": "roce", "efa": "efa", "eth-100g": "eth",
             "eth-25g": "eth", "eth-10g": "eth"}


def test_the_transport_table_covers_every_catalogue_link_between_nodes():
    assert sorted(TRANSPORT) == sorted(INTER)  # a new link in the catalogue needs a row here


@pytest.mark.parametrize("name", INTER + INTER_ALIASES + [n.upper() for n in INTER[:2]])
def test_launch_takes_every_name_plan_takes_and_estimates_on_the_same_link(name):
    transport, link = resolve_interconnect(name, None)
    assert link == get_interconnect(name).name  # plan reads the same name as this link
    assert transport == TRANSPORT[link]


@pytest.mark.parametrize("name, transport", [("eth", "eth"), ("ethernet", "eth"), ("tcp", "eth"),
                                             ("infiniband", "ib"), ("nvlink", "nvlink"), ("nvlink-a100", "nvlink")])
def test_transports_and_one_node_links_still_work(name, transport):
    got, link = resolve_interconnect(name, None)
    assert got == transport and link is None  # the estimate uses the transport's default link
    assert resolve_interconnect(name, "eth-25g") == (transport, "eth-25g")


def _slurm(tmp_path, capsys, *args):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  name: llama-3-8b\n")
    rc = main(["launch", "slurm", str(recipe), "--nodes", "2", "--ifname", "eth0", *args])
    return rc, capsys.readouterr()


@pytest.mark.parametrize("name, transport", [("eth-100g", "eth"), ("ndr", "ib"), ("roce-400", "roce"),
                                             ("ib-hdr-200", "ib")])
def test_the_script_carries_the_transports_environment(tmp_path, capsys, name, transport):
    rc, out = _slurm(tmp_path, capsys, "--interconnect", name)
    assert rc == 0, out.err
    for key, value in env_dict(preset(transport, "eth0")).items():
        assert re.search(rf"{key}=['\"]?{re.escape(value)}", out.out), (key, value)


def test_an_unknown_interconnect_is_one_line_naming_the_catalogue(tmp_path, capsys):
    rc, out = _slurm(tmp_path, capsys, "--interconnect", "ib-xdr-800")
    assert rc == 2 and len(out.err.strip().splitlines()) == 1
    assert all(n in out.err for n in INTER), out.err


def test_launch_and_plan_help_list_the_same_links(capsys):
    assert main(["launch", "torchrun", "-h"]) == 0
    launch = " ".join(capsys.readouterr().out.split())
    assert main(["plan", "-h"]) == 0
    plan = " ".join(capsys.readouterr().out.split())
    for name in INTER:
        assert name in launch and name in plan, name
    assert "<str>" not in launch[launch.index("Options:"):] and "<int>" not in launch[launch.index("Options:"):]


def test_train_flags_show_their_choices_and_metavars(capsys):
    assert main(["train", "-h"]) == 0
    typer_help = " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        parse_args(["-h"])
    argparse_help = " ".join(capsys.readouterr().out.split())
    assert f"--strategy [{'|'.join(STRATEGIES)}]" in typer_help
    assert f"--precision [{'|'.join(PRECISIONS)}]" in typer_help
    for flag in TRAIN_FLAGS:
        assert flag.help and f"{flag.option} {flag.metavar}" in typer_help, flag.option
        assert f"{flag.option} {flag.metavar}" in argparse_help, flag.option
        assert "<" not in flag.metavar


@pytest.mark.parametrize("argv, usage", [
    (["train"], "Usage: shardtune train [OPTIONS] RECIPE [OVERRIDES]..."),
    (["launch", "k8s"], "Usage: shardtune launch k8s [OPTIONS] RECIPE [KEY=VALUE]..."),
    (["export"], "Usage: shardtune export [OPTIONS] CHECKPOINT_DIR OUT_DIR"),
    (["generate"], "Usage: shardtune generate [OPTIONS] TARGET"),
    (["plan"], "Usage: shardtune plan [OPTIONS] [MODEL] [OVERRIDES]..."),
])
def test_arguments_read_as_a_posix_usage(capsys, argv, usage):
    assert main([*argv, "-h"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == usage
    arguments = out[out.index("Arguments:"):out.index("Options:")]
    assert not re.search(r"[{}]|<(str|int|float|list\[str\])>", arguments), arguments
