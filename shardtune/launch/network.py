"""Environment for NCCL and gloo per interconnect, each variable with why and where it is documented.

Only what a fabric needs is set; NCCL's own detection is good, and a stale tuning variable kept in
a script is a known cause of slow or hung jobs (NCCL's env page, "Debugging" section: such
variables "should not be used in production nor retained in scripts"). Values that depend on the
cluster (interface and HCA names) are set only when the user gives them, and otherwise appear as
a commented hint.

Sources (checked for the exact variable names):
- NCCL: https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
- gloo / torch.distributed: https://docs.pytorch.org/docs/stable/distributed.html#common-environment-variables
- AWS EFA + NCCL: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start-nccl.html
- libfabric EFA provider: https://ofiwg.github.io/libfabric/main/man/fi_efa.7.html
- aws-ofi-nccl plugin name: https://github.com/aws/aws-ofi-nccl (src: "AWS Libfabric" kept as an
  accepted NCCL_NET name by later plugin versions)
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass

NCCL_ENV_URL = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"
TORCH_ENV_URL = "https://docs.pytorch.org/docs/stable/distributed.html#common-environment-variables"
EFA_NCCL_URL = "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start-nccl.html"
FI_EFA_URL = "https://ofiwg.github.io/libfabric/main/man/fi_efa.7.html"
OFI_NCCL_URL = "https://github.com/aws/aws-ofi-nccl"


@dataclass(frozen=True)
class EnvSetting:
    """One environment variable. `value` None: shown as a commented hint, not set."""

    name: str
    value: str | None
    why: str
    doc: str
    hint: str = ""  # example value for a commented hint


def _ifname_settings(ifname: str | None, fabric_note: str) -> list[EnvSetting]:
    """Interface pinning for NCCL's bootstrap/socket traffic and for gloo (CPU collectives)."""
    nccl_value = None if ifname is None else ",".join("=" + p for p in ifname.split(","))
    return [
        EnvSetting("NCCL_SOCKET_IFNAME", nccl_value,
                   f"pin NCCL's sockets to the training network ({fabric_note}); '=' matches the name exactly",
                   NCCL_ENV_URL + "#nccl-socket-ifname", hint="=eth0"),
        EnvSetting("GLOO_SOCKET_IFNAME", ifname,
                   "gloo (CPU collectives, object broadcasts) otherwise binds to the interface the hostname "
                   "resolves to",
                   TORCH_ENV_URL, hint="eth0"),
    ]


def preset(interconnect: str, ifname: str | None = None, ib_hca: str | None = None) -> list[EnvSetting]:
    """The environment for `interconnect` (nvlink, ib, roce, efa, eth)."""
    if interconnect == "nvlink":
        # One node: NCCL uses NVLink P2P (and NVLS on NVSwitch systems) by itself.
        return [EnvSetting("NCCL_P2P_LEVEL", None,
                           "nothing to set on one NVLink node; pin P2P to NVLink only if NCCL_DEBUG=INFO shows PCIe "
                           "paths",
                           NCCL_ENV_URL + "#nccl-p2p-level", hint="NVL")]
    if interconnect == "ib":
        return _ifname_settings(ifname, "bootstrap only; data goes over IB verbs") + [
            EnvSetting("NCCL_IB_HCA", ib_hca,
                       "choose the HCAs (and ports) NCCL uses when the node has NICs it must not use",
                       NCCL_ENV_URL + "#nccl-ib-hca", hint="mlx5_0,mlx5_1"),
        ]
    if interconnect == "roce":
        return _ifname_settings(ifname, "bootstrap only; data goes over RoCE verbs") + [
            EnvSetting("NCCL_IB_HCA", ib_hca,
                       "choose the RoCE NICs NCCL uses", NCCL_ENV_URL + "#nccl-ib-hca", hint="mlx5_0,mlx5_1"),
            EnvSetting("NCCL_IB_GID_INDEX", "3",
                       "RoCE v2 (routable, UDP/IP) GID; index 3 is the usual IPv4 RoCE v2 entry "
                       "(check: show_gids). NCCL >= 2.21 selects it itself; older NCCL may pick RoCE v1",
                       NCCL_ENV_URL + "#nccl-ib-gid-index"),
            EnvSetting("NCCL_IB_TC", None,
                       "traffic class of the lossless (PFC/ECN) priority your switches reserve for RoCE",
                       NCCL_ENV_URL + "#nccl-ib-tc", hint="106"),
        ]
    if interconnect == "efa":
        return _ifname_settings(ifname, "bootstrap only; data goes over EFA through libfabric") + [
            EnvSetting("FI_PROVIDER", "efa",
                       "make libfabric use the EFA provider, never fall back to TCP", EFA_NCCL_URL),
            EnvSetting("FI_EFA_USE_DEVICE_RDMA", "1",
                       "use EFA RDMA read for GPUDirect on instances that support it (p4d, p5)", FI_EFA_URL),
            EnvSetting("NCCL_NET", "AWS Libfabric",
                       "fail instead of silently falling back to NCCL's TCP sockets when the aws-ofi-nccl plugin is "
                       "missing",
                       NCCL_ENV_URL + "#nccl-net"),
        ]
    if interconnect == "eth":
        return _ifname_settings(ifname, "all traffic goes over TCP") + [
            EnvSetting("NCCL_IB_DISABLE", "1",
                       "no InfiniBand/RoCE here: use TCP sockets without probing for verbs devices",
                       NCCL_ENV_URL + "#nccl-ib-disable"),
            EnvSetting("NCCL_SOCKET_NTHREADS", "4",
                       "more CPU threads per connection: one thread cannot fill a fast TCP link "
                       "(NCCL suggests 4 for generic 100G networks; threads x sockets <= 64)",
                       NCCL_ENV_URL + "#nccl-socket-nthreads"),
            EnvSetting("NCCL_NSOCKS_PERTHREAD", "4",
                       "several sockets per thread spread one transfer over more TCP flows",
                       NCCL_ENV_URL + "#nccl-nsocks-perthread"),
        ]
    raise ValueError(f"unknown interconnect {interconnect!r}")  # spec.normalize_interconnect ran before


def env_dict(settings: list[EnvSetting]) -> dict[str, str]:
    """The variables that are set (hints left out)."""
    return {s.name: s.value for s in settings if s.value is not None}


def shell_lines(settings: list[EnvSetting]) -> list[str]:
    """`export` lines (quoted) with a comment above each; hints as commented exports."""
    lines = []
    for s in settings:
        lines.append(f"# {s.why}. Docs: {s.doc}")
        if s.value is None:
            lines.append(f"# export {s.name}={shlex.quote(s.hint)}")
        else:
            lines.append(f"export {s.name}={shlex.quote(s.value)}")
    return lines
