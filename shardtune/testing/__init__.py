"""Test helpers other areas can reuse (e.g. `netns.TwoHosts` for two emulated hosts on one machine)."""
