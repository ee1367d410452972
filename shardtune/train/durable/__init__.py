"""Durability: DCP checkpoints (checkpoint, ckpt_files, safe_load, shards, integrity), which one to
resume (choice, compat), the run keeper (keeper), failures and signals (resilience, faults,
watchdog, diskfull), the Hugging Face export (export, export_files)."""
