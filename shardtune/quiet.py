"""Third-party notices that are not for the user's terminal, silenced at the source.

Each entry is an exact message (or a library's own logger) seen on a plain `shardtune train`, with
why it is noise; nothing else is hidden. `SHARDTUNE_VERBOSE=1` shows them all again. Called by each
entry point (the CLI, every rank) before the heavy imports."""
from __future__ import annotations

import logging
import os
import re
import warnings

# (message regex from its start, category, module regex): warnings.filterwarnings' fields
WARNINGS = (
    # torch's ModTracker (the memory tracker, train/core/memtrack.py) under activation checkpointing and
    # FSDP2's hooks: printed twice per run, tearing the progress bar; the tracked figures are checked
    # against the planner's in every run's summary
    (r"The module hierarchy tracking maybe be messed up\. Please file a bug to PyTorch", UserWarning,
     r"torch\.distributed\._tools\.mod_tracker"),
    # setuptools' shim when a library imports distutils (torch's C++ builder): about setuptools itself
    (r"Setuptools is replacing distutils", UserWarning, r"_distutils_hack"),
    (r"", Warning, r"setuptools(\.|$)"),
)
# libraries' loggers whose warnings are about themselves: torchao "Failed to load <CUDA kernel .so>"
# on a machine without those kernels; torch's pytree: an Enum deprecation torchao triggers;
# bitsandbytes "Failed to load CPU gemm_4bit_forward from kernels-community" (an optional kernel;
# its fallback is used); `kernels`, on that lookup offline: "Skipping publisher trust check ... offline mode"
LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes", "kernels")
# (logger, message regex from its start): one message of a logger whose other warnings stay.
# DTensor, on every rank of every tp run, at the gradient norm (clip_grad_norm_ over the (dp_shard,
# tp) mesh): "While redistributing from (_NormPartial(2.0), _NormPartial(2.0)) to (Replicate(),
# Replicate()), 2 sequential all_reduce operations will be performed ..." - two all-reduces of one
# scalar per step, in the same order on every rank
MESSAGES = (("torch.distributed.tensor._redistribute", r"While redistributing from \(_NormPartial"),)


class _Drop(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet_third_party() -> None:
    """Install the filters above (idempotent); nothing with SHARDTUNE_VERBOSE=1."""
    if os.environ.get("SHARDTUNE_VERBOSE") == "1":
        return
    for message, category, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for name, pattern in MESSAGES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_Drop(pattern))
