"""`python -m shardtune.train.forked LOG -- TORCHRUN_ARGS`: train/launcher/agent.py with the rank side
imported first, for ranks that torchrun forks from it (`--start-method=fork --run-path
shardtune/train/__main__.py`, train/launcher/supervise.py `forks_ranks`): each rank inherits torch,
transformers and the trainer's modules instead of importing them (~2 CPU-s a rank; docs/DESIGN.md
"The suite's cost"). Only where no GPU device node exists: nothing here starts a thread pool or
touches a device, so the fork copies imported modules and nothing else."""
from __future__ import annotations

import os
import sys

from shardtune.train.__main__ import import_rank_side
from shardtune.train.launcher.agent import main
from shardtune.train.launcher.supervise import PRELOAD_PEFT_ENV


def preload() -> None:
    """What every rank imports before its first step, imported once here."""
    from shardtune.errors import quiet_library_notices  # noqa: PLC0415 after the agent's stderr is its log

    quiet_library_notices()
    import_rank_side()
    if os.environ.get(PRELOAD_PEFT_ENV) == "1":
        import peft  # noqa: F401, PLC0415


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], preload=preload))
