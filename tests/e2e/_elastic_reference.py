"""A run several e2e files read, trained once a session (a launch costs ~10 s of imports):
the uninterrupted 2-process run of test_elastic.py's recipe, with the watchdog at a 5 s floor and
TMPDIR in its own folder, so test_watchdog.py reads from it that a normal run leaves no watcher
and no beat file behind (looked for 1.5 s after its end, as that test did with its own run)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from _cli import once, shared_root, train_recipe

from shardtune.train.durable.watchdog import WATCHER_NAME

ELASTIC_STEPS = 8
ELASTIC_RECIPE = """
name: elastic
model: {name: tiny-llama}
data: {generated_examples: 200}
parallel: {strategy: zero3, precision: fp32}
optim: {lr: 0.002, warmup_steps: 2}
train: {micro_batch: 2, seq_len: 64, max_steps: @STEPS@, timeout_s: 45}
checkpoint: {keep: 2}
""".replace("@STEPS@", str(ELASTIC_STEPS))  # the YAML braces rule out an f-string


def watchers_of(tmp: Path) -> list[int]:
    """Live watchdog processes of a run under `tmp`: a fresh interpreter whose command line names its
    beat file there, or a forked watcher (/proc/<pid>/comm `shardtune-watch`) whose rank's command
    line or open files name a path there."""
    out, under = [], str(tmp).encode()
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            forked = (d / "comm").read_bytes().strip() == WATCHER_NAME
            files = [os.fsencode(os.readlink(f)) for f in (d / "fd").iterdir()] if forked else []
        except OSError:
            continue
        if (b"shardtune.train.durable.watchdog" in cmd or forked) and any(under in c for c in cmd + files):
            out.append(int(d.name))
    return out


@dataclass
class Finished:
    tmp: Path  # the run is tmp/ref, its TMPDIR tmp/tmp
    rc: int
    text: str
    watchers_after: list[int]  # watcher processes alive 1.5 s after the launcher exited
    beats_after: list[str]  # beat files left in its TMPDIR then


def elastic_reference(tmp_path_factory) -> Finished:
    """`shardtune train ELASTIC_RECIPE --nproc 2 --checkpoint-every 2`, SHARDTUNE_WATCHDOG_S=5: once a
    test run, whichever pytest-xdist worker asks first (`_cli.once`; read-only)."""
    def build(tmp: Path) -> dict:
        (tmp / "tmp").mkdir()
        proc = train_recipe(tmp, ELASTIC_RECIPE, "--checkpoint-every", "2", out="ref", timeout_s=150,
                            env={"TMPDIR": str(tmp / "tmp"), "SHARDTUNE_WATCHDOG_S": "5"})
        time.sleep(1.5)  # a watcher notices its rank's end within a second
        return {"rc": proc.returncode, "text": proc.stdout, "watchers_after": watchers_of(tmp),
                "beats_after": [p.name for p in (tmp / "tmp").glob("shardtune-beat-*")],
                "readonly": [str(tmp / "ref")]}

    d = once(shared_root(tmp_path_factory), ["elastic reference", ELASTIC_RECIPE], build)
    return Finished(Path(next(iter(d["readonly"]))).parent, d["rc"], d["text"], d["watchers_after"], d["beats_after"])
