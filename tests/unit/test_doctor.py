"""`shardtune doctor` on this machine (no GPU): says so plainly, fails only for real problems."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from shardtune.errors import UserError
from shardtune.launch.doctor import check_checkpoint_dir, check_interfaces, check_rendezvous, filesystem_type

DOCTOR = [sys.executable, "-m", "shardtune.cli", "doctor"]


def _doctor(*args, env=None):
    return subprocess.run([*DOCTOR, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, start_new_session=True)


@pytest.mark.timeout(120)
def test_doctor_on_this_machine_reports_no_gpu_and_exits_zero(tmp_path):
    import torch

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        r = _doctor("--rdzv", f"127.0.0.1:{port}", "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no GPU: CPU-only; gloo backend" in r.stdout
    assert torch.__version__ in r.stdout
    assert "accepts connections" in r.stdout and "is writable" in r.stdout


@pytest.mark.timeout(120)
def test_doctor_fails_for_a_bad_interface(tmp_path):
    r = _doctor("--checkpoint-dir", str(tmp_path), env={"GLOO_SOCKET_IFNAME": "nosuchif0"})
    assert r.returncode == 1, r.stdout
    fails = [ln for ln in r.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1 and "nosuchif0" in fails[0], fails


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where, needle", [("file", "is a file, not a folder"),
                                           ("file/ckpt/runs", "cannot be created: {tmp}/file is a file"),
                                           ("dangling", "is a dangling link, not a folder")])
def test_a_checkpoint_dir_that_is_no_folder_is_one_line_and_exit_2(tmp_path, where, needle):
    (tmp_path / "file").write_text("x")  # a folder cannot be made under a regular file, even by root
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    before = sorted(tmp_path.rglob("*"))
    r = _doctor("--checkpoint-dir", str(tmp_path / where))
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)  # before any check: no table
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardtune: error") and needle.format(tmp=tmp_path) in err[0], err
    assert sorted(tmp_path.rglob("*")) == before and (tmp_path / "file").read_text() == "x"
    with pytest.raises(UserError, match="not a folder|cannot be created"):
        check_checkpoint_dir(str(tmp_path / where))


def test_doctor_bad_endpoint_is_a_usage_error():
    r = _doctor("--rdzv", "no-port-here")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""  # before any check


def test_rendezvous_unresolvable_host_fails():
    (c,) = check_rendezvous("no-such-host.invalid:29500")
    assert c.status == "fail" and "does not resolve" in c.detail


def test_rendezvous_port_on_this_host():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.listen()
        busy = check_rendezvous(f"127.0.0.1:{port}")[-1]
    assert busy.status == "ok" and "accepts connections" in busy.detail
    free = check_rendezvous(f"127.0.0.1:{port}")[-1]  # closed now: refused, and this node would host it
    assert free.status == "ok" and "is free" in free.detail


def test_interfaces_check_against_this_machine():
    ifaces = [name for _, name in socket.if_nameindex()]
    assert check_interfaces({"GLOO_SOCKET_IFNAME": ifaces[0], "NCCL_SOCKET_IFNAME": "=" + ifaces[0]})[0].status == "ok"
    assert [c.status for c in check_interfaces({"NCCL_SOCKET_IFNAME": "=nosuchif0"})] == ["fail"]
    assert check_interfaces({}) == []


def test_filesystem_type_matches_findmnt(tmp_path):
    r = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,TARGET", "--target", str(tmp_path)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip("findmnt not available")
    fstype, target = r.stdout.split()[:2]
    assert filesystem_type(tmp_path) == (fstype, target)
    shared = [c for c in check_checkpoint_dir(str(tmp_path)) if c.what == "shared?"][0]
    assert fstype in shared.detail


def test_missing_checkpoint_dir_is_judged_by_its_parent_and_not_created(tmp_path):
    target = tmp_path / "shared" / "runs"
    checks = check_checkpoint_dir(str(target))
    assert not (tmp_path / "shared").exists()  # doctor created nothing (the seed made it on local disk)
    assert list(tmp_path.iterdir()) == []  # and the probe is gone
    warn = [c for c in checks if c.what == "checkpoint dir" and c.status == "warn"]
    assert warn and "does not exist" in warn[0].detail
    ok = [c for c in checks if c.what == "checkpoint dir" and c.status == "ok"]
    assert ok and str(tmp_path) in ok[0].detail


def test_missing_checkpoint_dir_under_a_read_only_parent_fails(tmp_path):
    import os

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: permissions do not bind")
        checks = check_checkpoint_dir(str(ro / "ckpt"))
        assert any(c.status == "fail" and "not writable" in c.detail for c in checks)
        assert not (ro / "ckpt").exists()
    finally:
        ro.chmod(0o755)
