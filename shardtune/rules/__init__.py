"""Rules the planner and the trainer share, one module per concern, torch-free (layer 1 of
docs/DESIGN.md's table): loss.py (the cross-entropy's chunk count), flops.py (PaLM's FLOPs per token,
the trainer's MFU and the planner's step time), preference.py (which objectives hold a reference).
The layout of the ranks is layout.py's; the strategies and which options combine, strategies.py's;
context parallelism's, rules/cp.py's.
"""
