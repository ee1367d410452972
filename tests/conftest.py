"""Shared by every tier (unit, dist, e2e).

Helper modules are imported by name, never through sys.path edits in test files: pytest's default
import mode puts each test file's folder (tests/dist, tests/e2e) on sys.path, and this conftest's
folder, tests/, too. tests/_cli.py: the CLI as a user runs it; tests/dist/_harness.py + _rank.py:
the one worker harness (N gloo ranks; a case worker is `run_case` + `_rank.serve`);
tests/e2e/_runs.py: a one-process run and torch's own DCP reader."""
from __future__ import annotations

import functools

import pytest
from _cli import REPO, SharedRuns, metrics, shardtune_cli, train_recipe


@pytest.fixture(scope="session")
def repo():
    """The repository root (recipes/, README.md, docs/)."""
    return REPO


@pytest.fixture
def cli():
    """`cli(*args, timeout_s=, env=)`: `shardtune ARGS` from the repo root (`_cli.shardtune_cli`)."""
    return shardtune_cli


@pytest.fixture
def train_cli(tmp_path):
    """`train_cli(recipe_yaml, *args, nproc=2, out="run", env=, timeout_s=)`: the recipe written to
    tmp_path and trained through the CLI into tmp_path/<out> (`_cli.train_recipe`)."""
    return functools.partial(train_recipe, tmp_path)


@pytest.fixture
def read_metrics():
    """`read_metrics(run)`: the records of run/metrics.jsonl."""
    return metrics


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """`shared_run(recipe_yaml, *args, nproc=2) -> (run folder, completed process)`: trained once a
    session for each distinct recipe/args/nproc, shared across tests and files, read-only
    (`_cli.SharedRuns`; copy the folder to tmp_path before changing anything in it)."""
    return SharedRuns(tmp_path_factory.mktemp("shared")).get


@pytest.fixture(scope="session")
def shared_one_process_run(tmp_path_factory):
    """`shared_one_process_run(recipe_yaml) -> run folder`: `python -m shardtune.train` of the recipe
    (tests/e2e/_runs.py `one_process_run`) once a session per distinct recipe text, shared across
    files, read-only as `shared_run` is (a changed file fails the next get: copy it first)."""
    from _cli import _listing
    from _runs import one_process_run  # tests/e2e/_runs.py: on sys.path once an e2e file is collected

    root, runs = tmp_path_factory.mktemp("shared_one_process"), {}

    def get(recipe: str):
        if recipe not in runs:
            tmp = root / f"run{len(runs)}"
            tmp.mkdir()
            run = one_process_run(tmp, recipe)
            runs[recipe] = (run, _listing(run))
        run, listing = runs[recipe]
        now = _listing(run)
        changed = sorted(k for k in listing.keys() | now.keys() if listing.get(k) != now.get(k))
        assert not changed, f"a test changed the shared run {run} (copy it first): {changed[:8]}"
        return run
    return get


@pytest.fixture(scope="session")
def reported_run(tmp_path_factory):
    """(run folder, train process, report process) of `_cli.train_simulate_report`: one short tiny-cpu
    run on 2 processes with evaluation and samples, its simulation and its report, read by
    test_report and test_clean_output (read-only)."""
    from _cli import train_simulate_report

    return train_simulate_report(tmp_path_factory.mktemp("reported"))
