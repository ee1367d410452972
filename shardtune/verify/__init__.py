"""Verification: the trainer's step traced on fake tensors (simulate) and predicted vs measured
memory (compare)."""
