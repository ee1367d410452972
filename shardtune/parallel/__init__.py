"""Applying a strategy (ddp / zero1 / zero2 / zero3 / hsdp), AC, offload and precision to a model."""
