"""Tokenised data cache: per-rank RSS growth and start-up time, in-memory lists vs the Arrow cache.

For each generated dataset (text rows, byte tokenizer, so tokens = bytes + bos/eos), three fresh
processes build rank 0's loader of 2 ranks and take one micro-batch, side by side in one run:
  lists   today's path: read, tokenise and pack into Python lists (no data.cache_dir)
  first   with data.cache_dir, the cache absent: tokenise, pack, write Arrow, memory-map
  second  with the cache present: check it and memory-map it (no tokenising)
Private RSS growth = RssAnon after the batch − after the imports (/proc/self/status): what each
rank holds alone. The mapped cache pages a rank touches (page-cache pages, with the kernel's
readahead) are RssFile, shared by every rank of the node; printed beside. Rounds alternate order.

    .venv/bin/python bench/data_cache.py [--tokens 1e6 1e7] [--rounds 1]
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import numpy, pyarrow, torch  # noqa: F401 (imported before the measurement: both paths need torch)
import shardtune.train.data.cache, shardtune.train.data.sources  # noqa: F401
from shardtune.config import DataConfig, TrainConfig
from shardtune.train.data.dataset import build_dataloader
from shardtune.train.data.tokenizer import ByteTokenizer
def rss():
    st = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("Rss")}
    return st["RssAnon"], st["RssFile"] + st["RssShmem"]
path, cache = sys.argv[1], sys.argv[2] or None
(a0, f0), t0 = rss(), time.perf_counter()
ld = build_dataloader(DataConfig(path=path, cache_dir=cache), TrainConfig(seq_len=512, micro_batch=4),
                      ByteTokenizer(), 0, 2, 0)
next(ld)
t, (a1, f1) = time.perf_counter() - t0, rss()
print(json.dumps({"s": t, "rss": a1 - a0, "file": f1 - f0, "rows": ld.num_rows}))
"""


def _write(path: Path, tokens: int) -> None:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij klmnop") for _ in range(n)) for n in range(20, 400)]
    n = 0
    with open(path, "w") as f:
        while n < tokens:
            w = rng.choice(words)
            f.write(json.dumps({"text": w}) + "\n")
            n += len(w) + 2


def _run(path: Path, cache: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), cache], capture_output=True, text=True,
                         timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=float, nargs="+", default=[1e6, 1e7])
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in args.tokens:
            path = Path(tmp) / f"d{int(tokens)}.jsonl"
            _write(path, int(tokens))
            res: dict[str, list[dict]] = {"lists": [], "first": [], "second": []}
            for r in range(args.rounds):
                cache = str(Path(tmp) / f"cache{int(tokens)}-{r}")
                if r % 2:
                    res["first"].append(_run(path, cache))
                    res["second"].append(_run(path, cache))
                    res["lists"].append(_run(path, ""))
                else:
                    res["lists"].append(_run(path, ""))
                    res["first"].append(_run(path, cache))
                    res["second"].append(_run(path, cache))
            med = {k: sorted(v, key=lambda x: x["s"])[len(v) // 2] for k, v in res.items()}
            print(f"{tokens:.0e} tokens ({med['lists']['rows']} rows of 512):")
            for k, v in med.items():
                print(f"  {k:7s} start {v['s']:7.2f} s   private RSS growth {v['rss'] / 2**20:8.1f} MiB   "
                      f"(mapped file pages {v['file'] / 2**20:6.1f} MiB, shared)")
            print(f"  lists/second start {med['lists']['s'] / med['second']['s']:.1f}x, first/second "
                  f"{med['first']['s'] / med['second']['s']:.1f}x; RSS lists/second "
                  f"{med['lists']['rss'] / max(med['second']['rss'], 1):.1f}x", flush=True)


if __name__ == "__main__":
    main()
