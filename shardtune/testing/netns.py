"""Two emulated hosts on one Linux machine: network namespaces joined by a veth pair.

Each "host" is a network namespace with its own loopback and one interface of the same name
(`ifname`, like `eth0` on every node of a cluster), addressed 10.231.S.1/24 and 10.231.S.2/24, so
torch.distributed traffic between them really crosses the veth link, optionally capped with a `tc`
token bucket (`tbf`, each end shapes what it sends) and delayed with `netem` where the kernel has
sch_netem (if not, `setup` cleans up and raises RuntimeError naming tc's error). Needs root (or
CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2; `netns_unavailable_reason()` says why not, else None.
Usage: `with TwoHosts(rate_mbit=1000) as net: net.popen(0, cmd); net.run(1, cmd, timeout=10)`;
a worked example is in docs/multinode.md, section 3.

Cleanup on every exit path (`with`, `close()`, atexit, `cleanup_stale()` for namespaces whose
creator died): each process started through `popen`/`run` has its own session and its group is
killed (SIGTERM, then SIGKILL), any process left in a namespace is killed, the namespaces (and so
the veth pair) are deleted.
"""
from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

_NS_PREFIX = "shardtune-"
_counter = itertools.count()


def _tool(name: str) -> str | None:
    for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return shutil.which(name)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    ip = _tool("ip")
    if ip is None:
        raise RuntimeError("iproute2 `ip` not found")
    return subprocess.run([ip, *args], capture_output=True, text=True, timeout=30, check=check)


def netns_unavailable_reason() -> str | None:
    """None when two namespaces and a veth pair can be made here, else why not (for pytest.skip)."""
    if _tool("ip") is None:
        return "iproute2 `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    name = f"{_NS_PREFIX}probe-{os.getpid()}"
    try:
        r = _ip("netns", "add", name, check=False)
        if r.returncode != 0:
            return f"`ip netns add` is not permitted here: {r.stderr.strip()}"
        r = _ip("-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        if r.returncode != 0:
            return f"veth pairs are not permitted here: {r.stderr.strip()}"
        return None
    finally:
        _ip("netns", "del", name, check=False)


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, its address on the link, and the link's interface name."""

    ns: str
    addr: str
    ifname: str


class TwoHosts:
    """Two network namespaces joined by a veth pair; a context manager that always cleans up.

    Args:
        ifname: interface name inside both namespaces (at most 15 characters).
        rate_mbit: if set, a tbf qdisc caps each direction of the link at this many Mbit/s.
        delay_ms: if set, netem adds this one-way delay on each end (needs the kernel's sch_netem).
        subnet_octet: third octet S of 10.231.S.0/24; default derived from the pid and a counter
            so that concurrent users do not collide.
    """

    def __init__(self, ifname: str = "stv0", rate_mbit: float | None = None,
                 delay_ms: float | None = None, subnet_octet: int | None = None):
        n = next(_counter)
        self.ifname = ifname
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        octet = subnet_octet if subnet_octet is not None else (os.getpid() * 7 + n) % 250 + 1
        tag = f"{os.getpid()}-{n}"
        self.hosts = [Host(f"{_NS_PREFIX}{tag}-a", f"10.231.{octet}.1", ifname),
                      Host(f"{_NS_PREFIX}{tag}-b", f"10.231.{octet}.2", ifname)]
        self._procs: list[subprocess.Popen] = []
        self._up = False

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> TwoHosts:
        self.setup()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def setup(self) -> None:
        """Create the namespaces, the veth pair, addresses, and the optional shaping."""
        atexit.register(self.close)
        self._up = True  # from here on close() has something to undo
        try:
            a, b = self.hosts
            _ip("netns", "add", a.ns)
            _ip("netns", "add", b.ns)
            _ip("link", "add", "name", self.ifname, "netns", a.ns, "type", "veth",
                "peer", "name", self.ifname, "netns", b.ns)
            for h in self.hosts:
                _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", self.ifname)
                _ip("-n", h.ns, "link", "set", "lo", "up")
                _ip("-n", h.ns, "link", "set", self.ifname, "up")
                self._shape(h)
        except BaseException:
            self.close()
            raise

    def _shape(self, h: Host) -> None:
        if self.rate_mbit is None and self.delay_ms is None:
            return
        tc = _tool("tc")
        if tc is None:
            raise RuntimeError("`tc` (iproute2) is needed to shape the link")
        base = [_tool("ip"), "netns", "exec", h.ns, tc, "qdisc", "add", "dev", self.ifname]
        parent = ["root"]
        if self.delay_ms is not None:
            _tc(base + ["root", "handle", "1:", "netem", "delay", f"{self.delay_ms}ms"])
            parent = ["parent", "1:1"]
        if self.rate_mbit is not None:
            # burst must hold at least one timer tick of traffic at this rate (tc-tbf(8)); 1/100 s
            # of data, and never below 32 KiB, keeps the cap accurate at high rates.
            burst_bytes = max(32 * 1024, int(self.rate_mbit * 1e6 / 8 / 100))
            _tc(base + parent + ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst_bytes), "latency", "50ms"])

    def close(self) -> None:
        """Kill everything started here, then delete both namespaces (and with them the veth pair)."""
        if not self._up:
            return
        self._up = False
        for p in self._procs:
            _killpg(p)
        for h in self.hosts:
            r = _ip("netns", "pids", h.ns, check=False)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", h.ns, check=False)
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    # -- running commands --------------------------------------------------------------------
    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run inside host i's namespace."""
        return [_tool("ip"), "netns", "exec", self.hosts[i].ns, *argv]

    def popen(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` in host i's namespace in a new session; it is killed by `close()`."""
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(self.command(i, argv), **kwargs)
        self._procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` in host i's namespace to completion (output captured as text); on timeout its
        process group is killed and `subprocess.TimeoutExpired` is raised."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        p = self.popen(i, argv, **kwargs)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(p)
            raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _tc(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:  # e.g. "Specified qdisc kind is unknown": the kernel lacks sch_netem
        raise RuntimeError(f"{' '.join(argv[4:])} failed: {r.stderr.strip()}")


def _killpg(p: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM the process group, SIGKILL it after `grace_s`, and reap the leader."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    try:  # workers may outlive the leader: kill the group even after the leader exited
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def cleanup_stale() -> list[str]:
    """Delete namespaces left by TwoHosts instances whose creating process no longer exists."""
    removed = []
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(_NS_PREFIX):
            continue
        pid = name[len(_NS_PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            for p in _ip("netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(p), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed
