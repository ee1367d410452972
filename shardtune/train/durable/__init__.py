"""Durability: DCP checkpoints (checkpoint, ckpt_files), the run keeper (keeper), failures and
signals (resilience), the Hugging Face export (export)."""
