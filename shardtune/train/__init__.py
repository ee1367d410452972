"""The trainer: `python -m shardtune.train RECIPE [key=value ...]` under torchrun, or
`shardtune train RECIPE --nproc N`. Rooms: core/ (entry, loop, step, model, optimizer, metrics),
data/ (records, tokenizers, generated data), durable/ (checkpoints, keeper, resilience, export);
commands.py and __main__.py are the entry points."""
