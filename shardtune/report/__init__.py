"""Predicted (plan), simulated (plan --simulate) and measured (run folder) memory side by side."""
