"""The trainer's core: the torchrun entry and loop (main), the one step (step), the model build
and fill (model, lora), the optimizer (optim), metrics and memory tracking (metrics, memtrack)."""
