"""train/durable/resilience.py `exit_if_stuck`: a completed run whose teardown hangs still ends."""
import subprocess
import sys
import time

import pytest

SCRIPT = """
import threading, time
from shardtune.train.durable.resilience import exit_if_stuck

exit_if_stuck(0.5, "the teardown")
threading.Event().wait()  # a teardown that never returns
"""


@pytest.mark.timeout(60)
def test_a_stuck_teardown_ends_with_exit_0_and_one_line():
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    assert r.stderr.strip().splitlines() == [
        "shardtune: the teardown still running 0.5 s after the run completed; exiting (everything is saved)"]
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(60)
def test_a_teardown_that_finishes_is_not_cut_short():
    script = SCRIPT.replace("exit_if_stuck(0.5", "g = exit_if_stuck(2").replace(
        "threading.Event().wait()  # a teardown that never returns", "g.cancel(); time.sleep(3); print('done')")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout.strip(), r.stderr.strip()) == (0, "done", "")
