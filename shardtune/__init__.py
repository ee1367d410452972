"""shardtune: plan, run, launch and verify sharded fine-tuning."""
__version__ = "0.1.0"
