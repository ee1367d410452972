"""The trainer: `python -m shardtune.train RECIPE [key=value ...]` under torchrun, or
`shardtune train RECIPE --nproc N`. Launcher side (before torchrun, torch-free): commands.py,
flags, preflight, rerun, runlock, agent (torchrun's wrapper). Rank side: main (entry), loop
(set-up → loop → finish). One process: generation (`shardtune generate`, glue in
generate_commands.py), export_commands.py. Rooms: core/ (step, model, LoRA, optimizer, metrics),
data/ (records, tokenizers, the cache, generated data), durable/ (checkpoints, keeper, resilience,
export)."""
