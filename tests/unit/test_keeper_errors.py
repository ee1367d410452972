"""RunKeeper.resume on rank 0 turns only what a user can fix (a UserError, an OSError: a damaged or
unreadable run folder) into the one-line error every rank raises; any other exception is a bug and
keeps its type and traceback on rank 0 (issue 28: keeper.py turned every exception into a user
error). One gloo rank in this process stands for the world."""
from __future__ import annotations

import types
from datetime import timedelta

import pytest
import torch.distributed as dist

from shardtune.errors import UserError
from shardtune.processes import free_port
from shardtune.train.durable import keeper


@pytest.fixture(scope="module")
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def _resume(tmp_path, monkeypatch, exc: Exception):
    def choose(run_dir, ckpt_cfg):
        raise exc

    monkeypatch.setattr(keeper, "choose_checkpoint", choose)
    k = keeper.RunKeeper.__new__(keeper.RunKeeper)
    k.ctx, k.run_dir = types.SimpleNamespace(rank=0, world_size=1), tmp_path
    k.cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(resume="auto"))
    return k.resume()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [UserError("checkpoint step_4 is damaged"),
                                 PermissionError(13, "Permission denied", "/x/checkpoints")])
def test_what_a_user_can_fix_is_one_line(world_of_one, tmp_path, monkeypatch, exc):
    with pytest.raises(UserError) as e:
        _resume(tmp_path, monkeypatch, exc)
    assert str(e.value) == str(exc) and "\n" not in str(e.value)


@pytest.mark.timeout(60)
def test_a_bug_keeps_its_type_and_traceback(world_of_one, tmp_path, monkeypatch):
    with pytest.raises(KeyError) as e:
        _resume(tmp_path, monkeypatch, KeyError("step"))
    assert not isinstance(e.value, UserError)
    assert any(f.name == "choose" for f in e.traceback)  # raised where it happened, not re-made
