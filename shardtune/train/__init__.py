"""The trainer: `python -m shardtune.train RECIPE [key=value ...]` under torchrun, or
`shardtune train RECIPE --nproc N`. Modules: model (build/shard/init), step (the one training
step), main (setup and loop), metrics, data and tokenizer (instruction data), commands (CLI)."""
