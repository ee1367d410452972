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


@pytest.mark.timeout(60)
def test_a_rank_that_returns_exits_with_its_code_and_skips_interpreter_finalization(tmp_path):
    """train/__main__.py `exit_now`: finalization is where a gloo thread asking for the GIL aborts
    a rank whose run succeeded (SIGABRT); an atexit hook stands in for it here."""
    script = ("import atexit, runpy, sys\n"
              "atexit.register(lambda: print('finalized', flush=True))\n"
              f"sys.argv = ['shardtune.train', {str(tmp_path / 'missing.yaml')!r}]\n"
              "runpy.run_module('shardtune.train', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert r.returncode == 2, r.stderr
    assert "finalized" not in r.stdout
    assert r.stderr.strip().splitlines()[-1].startswith("shardtune: error:") and "missing.yaml" in r.stderr


def test_the_first_failure_is_never_a_rank_torchrun_stopped_with_sigterm_while_another_is_listed():
    from shardtune.train.durable.faults import PEER_EXIT, first_failed

    t = 1796450000.0  # torchrun's timestamps are whole seconds: the ties are the usual case
    assert first_failed([(0, -15, t), (1, -6, t)]) == (1, -6)  # rank 1 aborted, torchrun stopped rank 0
    assert first_failed([(0, PEER_EXIT, t), (1, -15, t), (2, 1, t + 1)]) == (2, 1)
    assert first_failed([(0, -15, t), (1, -15, t)]) == (0, -15)  # all stopped by SIGTERM: the earliest
    assert first_failed([(0, -15, t + 1), (1, PEER_EXIT, t)]) == (0, -15)
    assert first_failed([(1, -9, t + 1), (0, 1, t)]) == (0, 1)
