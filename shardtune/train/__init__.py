"""The trainer: `python -m shardtune.train RECIPE [key=value ...]` under torchrun, or
`shardtune train RECIPE --nproc N`. Rooms by where they run: launcher/ (before torchrun, no torch at
import: flags, preflight, rerun, runlock, agent), forked/ (the agent ranks are forked from where no
GPU exists), rank/ (every process under torchrun: main, context, loop). One process: generation
(`shardtune generate`). Glue: commands.py, export_commands.py, generate_commands.py, __main__.py.
Below them: core/ (step, model, LoRA, optimizer, metrics), data/ (records, tokenizers, the cache,
generated data), durable/ (checkpoints, keeper, resilience, export)."""
