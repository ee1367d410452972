"""The real-model MoE round trip, moved out of `make test` (issue 38 item 6): the upcycled SmolLM2 MoE
with all 30 layers through `shardtune train` (one step at lr 1e-46, zero3 and `--ep 2` on 2 processes)
and `shardtune export`, bit for bit, and the planner's MoE activations against the trainer's.

    .venv/bin/python bench/moe_roundtrip.py [--json OUT]

It runs tests/e2e/test_moe_roundtrip.py's upcycled cases with UPCYCLED_LAYERS=0 (the same assertions
`make test` runs on the first 2 layers): `UPCYCLED_LAYERS=0 pytest -q -p no:cacheprovider
tests/e2e/test_moe_roundtrip.py -k upcycled`. The folder is built once into .cache
(`python -m shardtune.testing.upcycle`). Exit status: pytest's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CMD = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/e2e/test_moe_roundtrip.py", "-k",
       "upcycled"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the command, its exit status, wall time and summary here")
    args = p.parse_args(argv)
    t0 = time.time()
    proc = subprocess.run(CMD, cwd=ROOT, env={**os.environ, "UPCYCLED_LAYERS": "0"}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=3600)
    wall = time.time() - t0
    print(proc.stdout)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    result = {"command": "UPCYCLED_LAYERS=0 " + " ".join(["pytest", *CMD[3:]]), "returncode": proc.returncode,
              "wall_s": round(wall, 1), "summary": summary}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
