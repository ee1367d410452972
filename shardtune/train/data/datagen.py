"""The built-in generated instruction dataset of the demo: short string tasks a tiny model learns.

Each example is {"prompt": "<task>: <input>\\n", "response": "<output>"}, e.g.
  {"prompt": "reverse: kfmq\\n", "response": "qmfk"}
  {"prompt": "upper: kfmq\\n", "response": "KFMQ"}
  {"prompt": "sort: kfmq\\n", "response": "fkmq"}
  {"prompt": "add: 37+5\\n", "response": "42"}
Tasks are mixed uniformly, inputs are 3–8 random lowercase letters (sums of two numbers below
100), all from `random.Random(seed)`: the same seed gives the same file on every machine.
A byte-level model first learns the format and the task words (the loss falls from ln 264 ≈ 5.6
to about 2 within a few dozen steps), then the per-character mappings (upper, reverse).

Write the dataset as JSONL to look at it or to edit it:
    python -m shardtune.train.data.datagen data.jsonl [--examples 4000] [--seed 1234]
"""
from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

TASKS = ("reverse", "upper", "sort", "add")


def _example(rng: random.Random) -> dict:
    task = rng.choice(TASKS)
    if task == "add":
        a, b = rng.randrange(100), rng.randrange(100)
        return {"prompt": f"add: {a}+{b}\n", "response": str(a + b)}
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
    out = {"reverse": word[::-1], "upper": word.upper(), "sort": "".join(sorted(word))}[task]
    return {"prompt": f"{task}: {word}\n", "response": out}


def generate_examples(num_examples: int, seed: int) -> list[dict]:
    """`num_examples` prompt/response dicts, deterministic in `seed`."""
    rng = random.Random(seed)
    return [_example(rng) for _ in range(num_examples)]


def write_jsonl(path: str | Path, num_examples: int, seed: int) -> Path:
    """Write the generated dataset as JSON Lines (one {"prompt", "response"} object a line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for ex in generate_examples(num_examples, seed):
            f.write(json.dumps(ex) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write shardtune's generated demo dataset as JSONL.")
    ap.add_argument("out", help="output .jsonl file")
    ap.add_argument("--examples", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    print(write_jsonl(args.out, args.examples, args.seed))


if __name__ == "__main__":
    main()
