"""Test fixtures other areas can reuse: `netns.TwoHosts` (two emulated hosts on one machine) and
the SmolLM2 pretrained-model folder (smollm2). proc.py is the old path of shardtune/processes.py."""
