"""`python -m shardtune.train RECIPE [--strategy S] [--precision P] [--max-steps K] [--seed X]
[--output-dir DIR] [key.path=value ...]`, one process per rank under torchrun.

Bad input: one line on stderr, exit code 2 (no traceback).
"""
from __future__ import annotations

import argparse
import sys

from shardtune.errors import UserError


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shardtune.train")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="key.path=value")
    p.add_argument("--strategy")
    p.add_argument("--precision")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--output-dir")
    p.add_argument("--checkpoint-every", type=int)
    p.add_argument("--keep", type=int)
    p.add_argument("--resume", help="auto | never | a checkpoints/step_N path")
    p.add_argument("--lora-rank", type=int, help="LoRA rank (lora.rank; 0: full fine-tune)")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    import os

    from shardtune.train.commands import resolve_config
    from shardtune.train.preflight import validate_for_launch

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = resolve_config(args.recipe, args.overrides, strategy=args.strategy, precision=args.precision,
                             max_steps=args.max_steps, seed=args.seed, output_dir=args.output_dir,
                             checkpoint_every=args.checkpoint_every, keep=args.keep, resume=args.resume,
                             lora_rank=args.lora_rank)
        world = int(os.environ.get("WORLD_SIZE", 1))
        validate_for_launch(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        from shardtune.train.core.main import run

        run(cfg)
    except UserError as e:
        if int(os.environ.get("RANK", "0")) == 0:  # the same error on every rank: print it once
            print(f"shardtune: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from shardtune.train.durable.resilience import is_peer_failure

        if not is_peer_failure(e):
            raise
        # another rank failed first and its error is the one to read: one line here, no traceback
        print(f"shardtune: rank {os.environ.get('RANK', '?')}: stopped because another rank failed "
              f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
