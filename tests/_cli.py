"""The CLI as a user types it, for every tier: `shardtune ARGS` run as `python -m shardtune.cli`
from the repository root, bounded (a hung run is killed with its process group, shardtune/testing/
proc.py), and what a run folder's metrics.jsonl holds. tests/conftest.py binds these to fixtures;
test files import them by name (tests/ is on sys.path through that conftest)."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from shardtune.processes import run_bounded

REPO = Path(__file__).resolve().parents[1]


def shardtune_cli(*args, timeout_s: float = 150, env: dict | None = None, stderr=subprocess.STDOUT,
                  cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`shardtune *args` with os.environ plus `env`; stderr into stdout unless told. The result
    also carries `.seconds`, the wall time of the command."""
    t0 = time.monotonic()
    proc = run_bounded([sys.executable, "-m", "shardtune.cli", *map(str, args)], timeout_s, cwd=cwd, stderr=stderr,
                       env={**os.environ, **(env or {})})
    proc.seconds = time.monotonic() - t0
    return proc


def train_recipe(tmp: Path, recipe: str, *args, nproc: int = 2, out: str = "run", **kw) -> subprocess.CompletedProcess:
    """Writes `recipe` (YAML text) to tmp/recipe.yaml and runs `shardtune train tmp/recipe.yaml
    --nproc N --output-dir tmp/<out> *args` (keywords as `shardtune_cli`)."""
    (tmp / "recipe.yaml").write_text(recipe)
    return shardtune_cli("train", tmp / "recipe.yaml", "--nproc", nproc, "--output-dir", tmp / out, *args, **kw)


def metrics(run: Path) -> list[dict]:
    """The records of run/metrics.jsonl, in order."""
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def refused_before_any_process(monkeypatch, capsys, argv: list) -> str:
    """`shardtune *argv` in this process with process starts forbidden: asserts exit 2 and one line
    of stderr, and returns that line (bad input is refused before torchrun or a rank starts)."""
    from shardtune import cli

    def no_process(*a, **k):
        raise AssertionError("a process was started for bad input")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    rc = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    return err


def _listing(folder: Path) -> dict[str, list[int]]:
    return {str(p.relative_to(folder)): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def once(root: Path, key, build) -> dict:
    """`build(folder) -> dict` (JSON) once per test run for `key`, whichever process asks first:
    under pytest-xdist every worker's session fixtures share `root` (the run's base temp folder),
    and a lock file per key makes the others wait and read the first one's result. The folder is
    read-only afterwards: each call checks that none of `result["readonly"]`'s files (the listing
    taken right after the build) was added, removed or rewritten, and fails naming them."""
    name = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    root.mkdir(parents=True, exist_ok=True)
    folder, done = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            folder.mkdir()
            result = build(folder)
            result["readonly"] = {str(p): _listing(p) for p in result.get("readonly", [])}
            done.write_text(json.dumps(result))
    result = json.loads(done.read_text())
    for path, listing in result["readonly"].items():
        now = _listing(Path(path))
        changed = sorted(k for k in listing.keys() | now.keys() if listing.get(k) != now.get(k))
        assert not changed, f"a test changed the shared run {path} (copy it first): {changed[:8]}"
    return result


def shared_root(tmp_path_factory) -> Path:
    """The folder `once` keeps its results in: this test run's base temp folder, the same for every
    pytest-xdist worker (each worker's own base folder lies inside it)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"


def _proc(d: dict) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(d["args"], d["returncode"], d["stdout"], d["stderr"])


def _proc_dict(p: subprocess.CompletedProcess) -> dict:
    return {"args": [str(a) for a in p.args], "returncode": p.returncode, "stdout": p.stdout, "stderr": p.stderr}


class SharedRuns:
    """One `shardtune train` per distinct (recipe, args, nproc) for the whole test run, shared by
    every test (and file, and pytest-xdist worker) that asks for the same run: a launch costs ~10 s
    of imports before its first step. The folder is read-only (`once`): copy it to change it."""

    def __init__(self, root: Path):
        self.root = root

    def get(self, recipe: str, *args, nproc: int = 2,
            timeout_s: float = 280) -> tuple[Path, subprocess.CompletedProcess]:
        def build(tmp: Path) -> dict:
            proc = train_recipe(tmp, recipe, *args, nproc=nproc, timeout_s=timeout_s)
            assert proc.returncode == 0, proc.stdout[-3000:]
            return {"run": str(tmp / "run"), "proc": _proc_dict(proc), "readonly": [tmp / "run"]}

        result = once(self.root, ["train", recipe, [str(a) for a in args], nproc], build)
        return Path(result["run"]), _proc(result["proc"])


# the one sample prompt of `train_simulate_report`'s run
SAMPLE_PROMPT = "Apply 'upper' to the input.\n\nabc"


def train_simulate_report(root: Path) -> tuple[Path, subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """What a user does after a short run, once for test_report and test_clean_output: `shardtune
    train recipes/tiny-cpu.yaml --nproc 2 --max-steps 4` with evaluation (data.val_split, eval at
    steps 2 and 4) and a sample prompt, no HF export; `plan tiny-llama … --simulate --json` saved
    as run/simulated.json (as the docs tell users); `shardtune report run`. Both commands with
    COLUMNS=140 (under pytest the piped console came out 80 wide, which abbreviates row labels the
    tests read). Returns (run folder, train process, report process), stdout and stderr apart."""
    run, cli = root / "run", [sys.executable, "-m", "shardtune.cli"]
    env = dict(os.environ, COLUMNS="140")
    train = run_bounded([*cli, "train", "recipes/tiny-cpu.yaml", "--nproc", "2", "--output-dir", str(run),
                         "--max-steps", "4", "data.generated_examples=400", "data.val_split=0.05",
                         "train.eval_every=2", f"train.sample_prompts={json.dumps([SAMPLE_PROMPT])}",
                         "train.sample_max_new_tokens=6", "checkpoint.export_hf=false"], timeout_s=400, cwd=REPO,
                        env=env)
    assert train.returncode == 0, (train.stdout + train.stderr)[-3000:]
    with open(run / "simulated.json", "w") as f:
        plan = run_bounded([*cli, "plan", "tiny-llama", "--gpus", "2", "--strategy", "zero3", "--seq-len", "128",
                            "--micro-batch", "8", "--precision", "fp32", "--simulate", "--json"], 120, cwd=REPO,
                           stdout=f)
    assert plan.returncode == 0, plan.stderr[-2000:]
    report = run_bounded([*cli, "report", str(run)], timeout_s=200, cwd=REPO, env=env)
    assert report.returncode == 0, (report.stdout + report.stderr)[-2000:]
    return run, train, report
