"""torchrun's agent for ranks forked from it (`python -m shardtune.train.forked`, __main__.py)."""
