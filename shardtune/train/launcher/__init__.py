"""The trainer's launcher side: what runs once per run before torchrun starts, in the `shardtune
train` process. No torch at import (tests/unit/test_layers.py): flags, preflight, rerun, runlock,
agent (torchrun's wrapper)."""
