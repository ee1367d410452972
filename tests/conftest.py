"""Shared by every tier (unit, dist, e2e).

Helper modules are imported by name, never through sys.path edits in test files: pytest's default
import mode puts each test file's folder (tests/dist, tests/e2e) on sys.path, and this conftest's
folder, tests/, too. tests/_cli.py: the CLI as a user runs it; tests/dist/_harness.py + _rank.py:
the one worker harness (N gloo ranks; a case worker is `run_case` + `_rank.serve`);
tests/e2e/_runs.py: a one-process run and torch's own DCP reader."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
from _cli import (
    REPO,
    SharedRuns,
    _proc,
    _proc_dict,
    metrics,
    once,
    shardtune_cli,
    shared_root,
    train_recipe,
    train_simulate_report,
)

# The longest units of `make test` (by their wall time in 2-worker runs of the suite: --durations of
# CI at 8980058 and the tmp folders' times of a full run; and by CPU-s of each file alone), started
# first in this order; every other file after them, most tests first (xdist's order). xdist's own
# order put these, which have 1-17 tests each, behind the cheap unit files with more tests, so a
# ~100 s file could start last on one worker while the other sat idle. Only an order: a stale or
# missing entry costs time, not a result.
LONGEST_FIRST = (
    "tests/dist",  # the tier: its 2-rank and 4-rank shared launches, then its own launches
    "tests/e2e/test_effective.py",  # ~750 s in a 2-worker run (compile and 8-bit AdamW launches)
    # files that mostly wait (a signal's effect, a hang's detection, a restart, a capped link): started
    # early, their waits overlap the CPU-bound files instead of leaving cores idle at the end (measured:
    # 25-35 % idle over the last 4 minutes of a 2-worker run with test_launcher_signals.py last)
    "tests/e2e/test_launcher_signals.py",
    "tests/e2e/test_watchdog.py",
    "tests/e2e/test_two_hosts.py",
    "tests/e2e/test_elastic.py",
    "tests/e2e/test_moe_cli.py",  # 11 launches
    "tests/e2e/test_moe_lora.py",  # 11 launches
    "tests/e2e/test_grpo_cli.py",
    "tests/e2e/test_pp.py",
    "tests/e2e/test_moe_roundtrip.py",
    "tests/e2e/test_dpo_cli.py",
    "tests/e2e/test_tp_cli.py",
    "tests/e2e/test_dpo_tp_cp.py",
    "tests/e2e/test_tied_export.py",
    "tests/e2e/test_cp_cli.py",
    "tests/e2e/test_gpu_script.py",
    "tests/e2e/test_disk_full.py",
    "tests/e2e/test_sample_prompts.py",
    "tests/dist/test_prune.py",  # two 2-rank launches of its own, no shared launch
)


def pytest_xdist_make_scheduler(config, log):
    """`make test`'s `--dist loadfile`, with the whole dist tier as ONE unit: a file's tests on one worker
    (its module fixtures run once) and every tests/dist file that declares shared launches
    (DIST_LAUNCHES) on the same worker, so that while the tier's shared launches run
    (tests/dist/conftest.py) the other worker goes on with its own files instead of waiting on their
    lock (tests/dist/test_prune.py, its own launches only, goes to either worker). (xdist's
    loadgroup cannot say this under pytest 9: it renames node ids through an attribute pytest 9 no
    longer reads.) Units start in LONGEST_FIRST's order, the rest after them (longest processing
    time first: the cheap files even out the end)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from collections import OrderedDict  # noqa: PLC0415 only under pytest-xdist

    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415 only under pytest-xdist

    rank = {scope: i for i, scope in enumerate(LONGEST_FIRST)}

    @functools.cache
    def shares_a_launch(path: str) -> bool:  # a tests/dist file without DIST_LAUNCHES is a file like any other
        return "DIST_LAUNCHES" in (Path(config.rootpath) / path).read_text()

    class FilesAndTheDistTier(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/dist" if path.startswith("tests/dist/") and shares_a_launch(path) else path

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_longest_first", False):  # the queue is whole before the first unit goes
                self._longest_first = True
                order = sorted(self.workqueue, key=lambda scope: rank.get(scope, len(rank)))  # stable
                self.workqueue = OrderedDict((scope, self.workqueue[scope]) for scope in order)
            super()._assign_work_unit(node)

    return FilesAndTheDistTier(config, log)


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
    test run for each distinct recipe/args/nproc, shared across tests, files and pytest-xdist
    workers, read-only (`_cli.SharedRuns`; copy the folder to tmp_path before changing it)."""
    return SharedRuns(shared_root(tmp_path_factory)).get


@pytest.fixture(scope="session")
def shared_one_process_run(tmp_path_factory):
    """`shared_one_process_run(recipe_yaml) -> run folder`: `python -m shardtune.train` of the recipe
    (tests/e2e/_runs.py `one_process_run`) once a test run per distinct recipe text, shared as
    `shared_run` is and read-only (a changed file fails the next get: copy it first)."""
    from _runs import one_process_run  # tests/e2e/_runs.py: on sys.path once an e2e file is collected

    def get(recipe: str) -> Path:
        def build(tmp: Path) -> dict:
            run = one_process_run(tmp, recipe)
            return {"run": str(run), "readonly": [run]}
        return Path(once(shared_root(tmp_path_factory), ["one process", recipe], build)["run"])
    return get


@pytest.fixture(scope="session")
def reported_run(tmp_path_factory):
    """(run folder, train process, report process) of `_cli.train_simulate_report`: one short tiny-cpu
    run on 2 processes with evaluation and samples, its simulation and its report, read by
    test_report and test_clean_output (read-only), once a test run."""
    def build(tmp: Path) -> dict:
        run, train, report = train_simulate_report(tmp)
        return {"run": str(run), "train": _proc_dict(train), "report": _proc_dict(report), "readonly": [run]}
    result = once(shared_root(tmp_path_factory), ["reported"], build)
    return Path(result["run"]), _proc(result["train"]), _proc(result["report"])
