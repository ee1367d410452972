"""The trainer's core, rank side: the one step (step, chunked_loss, dpo, dpo_ref), the model build and
fill (model, lora, qlora), the optimizer (optim), evaluation and sampling (evaluate, sampling,
samples, eval_lines), metrics and memory (metrics, memtrack, memory_json, effective), loggers."""
