"""`shardtune doctor`: what this node has and what would stop a multi-node run, in plain words.

Each check returns a `Check` with a status: ok, info (a fact, not a problem: "no GPU: CPU-only"),
warn (may be fine, say why), fail (a run would not work). Only `fail` makes the command exit
non-zero. torch is imported inside `check_torch`, so the rest works without it.
"""
from __future__ import annotations

import errno
import os
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from shardtune.errors import UserError
from shardtune.launch.spec import _HOST

# Filesystem types (as in /proc/mounts) that other nodes can see: network and cluster filesystems.
SHARED_FS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs",
             "cifs", "smb3", "9p", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.mountpoint-s3", "wekafs",
             "fuse.juicefs", "panfs", "fuse.weka", "virtiofs", "efs"}
LOCAL_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "vfat", "ramfs"}


@dataclass(frozen=True)
class Check:
    status: str  # ok | info | warn | fail
    what: str
    detail: str


def check_torch() -> list[Check]:
    """torch, CUDA and NCCL versions, visible GPUs, available backends."""
    try:
        import torch  # noqa: PLC0415 torch failing to import is the doctor's finding
        import torch.distributed as dist  # noqa: PLC0415 torch failing to import is the doctor's finding
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        return [Check("fail", "torch", f"cannot import torch: {e}")]
    out = [Check("ok", "torch", torch.__version__)]
    cuda_build = torch.version.cuda
    if cuda_build is None:
        out.append(Check("info", "CUDA", "this torch build has no CUDA (CPU-only wheel)"))
    else:
        out.append(Check("ok", "CUDA", f"torch built with CUDA {cuda_build}"))
    n = torch.cuda.device_count() if cuda_build else 0
    if n == 0:
        out.append(Check("info", "GPUs", "no GPU: CPU-only; gloo backend"))
    else:
        names = [torch.cuda.get_device_name(i) for i in range(n)]
        out.append(Check("ok", "GPUs", f"{n} visible: {', '.join(names)}"))
    if dist.is_nccl_available() and cuda_build:
        v = torch.cuda.nccl.version()
        out.append(Check("ok", "NCCL", ".".join(map(str, v)) if isinstance(v, tuple) else str(v)))
    else:
        out.append(Check("info", "NCCL", "not in this torch build; collectives use gloo"))
    if not dist.is_gloo_available():
        out.append(Check("warn" if n else "fail", "gloo", "torch.distributed has no gloo backend"))
    return out


def check_interfaces(env: dict | None = None) -> list[Check]:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name interfaces this node has."""
    env = os.environ if env is None else env
    have = {name for _, name in socket.if_nameindex()}
    out = []
    gloo = env.get("GLOO_SOCKET_IFNAME")
    if gloo:
        missing = [i for i in gloo.split(",") if i not in have]
        if missing:
            out.append(Check("fail", "GLOO_SOCKET_IFNAME", f"{gloo!r}: no interface {', '.join(missing)} here "
                             f"(this node has {', '.join(sorted(have))})"))
        else:
            out.append(Check("ok", "GLOO_SOCKET_IFNAME", gloo))
    nccl = env.get("NCCL_SOCKET_IFNAME")
    if nccl and not nccl.startswith("^"):
        prefixes = [p.lstrip("=") for p in nccl.split(",")]
        exact = [p.startswith("=") for p in nccl.split(",")]
        if not any((n in have) if ex else any(h.startswith(n) for h in have) for n, ex in zip(prefixes, exact)):
            out.append(Check("fail", "NCCL_SOCKET_IFNAME", f"{nccl!r} matches no interface here "
                             f"(this node has {', '.join(sorted(have))})"))
        else:
            out.append(Check("ok", "NCCL_SOCKET_IFNAME", nccl))
    return out


def parse_endpoint(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if (not sep or not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535
            or not _HOST.fullmatch(host)):
        raise UserError(f"--rdzv {value!r} is not HOST:PORT (e.g. node001:29500)")
    return host.strip("[]"), int(port)


def _local_addresses() -> set[str]:
    addrs = {"127.0.0.1", "::1", "localhost", socket.gethostname()}
    try:
        addrs |= {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    return addrs


def check_rendezvous(endpoint: str, timeout_s: float = 3.0) -> list[Check]:
    """Resolve the rendezvous host and try its port: reachable, refused (nothing there yet) or silent."""
    host, port = parse_endpoint(endpoint)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return [Check("fail", "rendezvous", f"{host!r} does not resolve ({e.strerror}); use a name or address every "
                                            "node can resolve")]
    addr = infos[0][4][0]
    out = [Check("ok", "rendezvous host", f"{host} -> {addr}")]
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            out.append(Check("ok", "rendezvous port", f"{host}:{port} accepts connections (a rendezvous is running "
                                                      "there)"))
    except ConnectionRefusedError:
        if host in _local_addresses() or addr in _local_addresses():
            out.append(_check_bindable(port))
        else:
            out.append(Check("info", "rendezvous port", f"{host}:{port} is reachable but nothing listens yet "
                             "(fine before the first node starts torchrun)"))
    except TimeoutError:
        out.append(Check("fail", "rendezvous port", f"{host}:{port} did not answer in {timeout_s:.0f} s: "
                         "a firewall or route drops the traffic; open the port between the nodes"))
    except OSError as e:
        out.append(Check("fail", "rendezvous port", f"{host}:{port}: {e.strerror or e}"))
    return out


def _check_bindable(port: int) -> Check:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return Check("fail", "rendezvous port", f"this node is the rendezvous host and port {port} is in "
                                                        "use; choose another --rdzv-port")
            return Check("fail", "rendezvous port", f"cannot bind port {port}: {e.strerror}")
    return Check("ok", "rendezvous port", f"this node is the rendezvous host; port {port} is free")


def filesystem_type(path: Path) -> tuple[str, str]:
    """(fstype, mount point) of the mount that holds `path`, from /proc/mounts (longest prefix)."""
    best = ("unknown", "/")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    real = str(path.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
            best = (parts[2], mnt)
    return best


def nearest_existing(directory: str) -> tuple[Path, Path]:
    """(the folder, its nearest existing self or parent); one line (UserError) when the path is
    not a folder or could never be one (it, or a parent, is a file or a dangling link)."""
    d = Path(directory).expanduser()
    existing = d
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "a file" if existing.is_file() else "a dangling link" if existing.is_symlink() else \
            "a special file"
        why = f"is {what}, not a folder" if existing == d else f"cannot be created: {existing} is {what}"
        raise UserError(f"--checkpoint-dir {directory!r} {why}; give the folder checkpoints will be written to")
    return d, existing


def check_checkpoint_dir(directory: str) -> list[Check]:
    """Writable (create, write, fsync, rename, delete a probe), free space, and whether it looks
    shared. Creates nothing but the probe: a folder that does not exist yet is judged by its
    nearest existing parent (where the trainer would create it), with a WARN. A path that is not
    a folder, or lies under a file, is one line (UserError)."""
    d, existing = nearest_existing(directory)
    out = []
    if existing != d:
        out.append(Check("warn", "checkpoint dir", f"{d} does not exist (yet); checking {existing}, where it "
                         "would be created: on several nodes, is the shared filesystem mounted here?"))
    try:
        probe = existing / f".shardtune-probe-{uuid.uuid4().hex}"
        tmp = probe.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, probe)  # checkpoints are committed by rename: it must work here
        probe.unlink()
        out.append(Check("ok", "checkpoint dir", f"{existing} is writable (write, fsync, rename)"))
    except OSError as e:
        return out + [Check("fail", "checkpoint dir", f"{existing} is not writable: {e.strerror or e}")]
    d = existing
    free = shutil.disk_usage(d).free
    out.append(Check("ok" if free > 10 * 2**30 else "warn", "free space", f"{free / 2**30:.1f} GiB free at {d}"))
    fstype, mnt = filesystem_type(d)
    if fstype in SHARED_FS or (fstype.startswith("fuse.") and fstype != "fuse.fuse-overlayfs"):
        out.append(Check("ok", "shared?", f"{fstype} at {mnt}: a network/cluster filesystem, other nodes can see it "
                         "if they mount it at the same path (run doctor there too)"))
    else:
        out.append(Check("warn", "shared?", f"{fstype} at {mnt} is local to this node: fine on one node, but "
                         "for several nodes checkpoints must go to a shared filesystem (NFS, Lustre, ...)"))
    return out


def run_doctor(rdzv: str | None = None, checkpoint_dir: str | None = None) -> list[Check]:
    """Every check; a bad argument (HOST:PORT, a --checkpoint-dir that is no folder) is one line
    (UserError) before any check runs."""
    if rdzv:
        parse_endpoint(rdzv)
    if checkpoint_dir:
        nearest_existing(checkpoint_dir)
    checks = check_torch() + check_interfaces()
    if rdzv:
        checks += check_rendezvous(rdzv)
    if checkpoint_dir:
        checks += check_checkpoint_dir(checkpoint_dir)
    return checks


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.what) for c in checks)
    return "\n".join(f"{c.status.upper():<4}  {c.what:<{width}}  {c.detail}" for c in checks)
