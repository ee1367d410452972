"""Data with sources: model architectures (HF config.json values), GPUs, interconnects."""
