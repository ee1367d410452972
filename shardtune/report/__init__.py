"""`shardtune report RUN_DIR`: plots and tables of a run folder (the comparison itself: verify/compare.py)."""
