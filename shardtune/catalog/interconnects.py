"""Interconnects: line rate, typical achieved bus bandwidth and per-step latency, each with a source.

Bandwidths are in GB/s (10^9 bytes per second), one direction, per GPU for links inside a node
and per NIC for links between nodes. "Achieved" is the bus bandwidth (busbw) that nccl-tests
reports for large messages with the ring algorithm (NVIDIA nccl-tests, doc/PERFORMANCE.md: busbw
is the number to compare against the hardware's peak), so it already contains protocol overhead.
`alpha_s` is the latency of one ring step (one send/receive between neighbours) used by the α-β
model in `shardtune.plan.timing`: t = steps·α + bytes/busbw. It is an order-of-magnitude value
(small-message times of nccl-tests divided by the ring's step count); it matters only for small
messages. Imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardtune.errors import UserError, suggest

GBIT_TO_GBPS = 1 / 8  # Gb/s (10^9 bits) → GB/s (10^9 bytes)


@dataclass(frozen=True)
class Interconnect:
    """One link type. `scope` is "intra" (inside a node, per GPU) or "inter" (between nodes, per NIC)."""

    name: str
    scope: str
    line_rate_gbps: float  # GB/s per GPU (intra) or per NIC (inter), one direction
    achieved_busbw_gbps: float  # GB/s, large-message ring busbw (nccl-tests definition)
    alpha_s: float  # s, latency per ring step
    nics_per_node: int  # inter only: NICs a node usually has (8 GPUs); 0 for intra
    source: str
    note: str = ""


def _eth(name: str, gbit: float, nics: int) -> Interconnect:
    # TCP over Ethernet with a 1500-byte MTU carries 1448 payload bytes per 1538 bytes on the wire
    # (Ethernet preamble + header + FCS + IFG = 38, IPv4 20, TCP with timestamps 32): 94 %.
    # NCCL's socket transport gets close to that for large messages on an idle link; we take 90 %.
    return Interconnect(
        name=name, scope="inter", line_rate_gbps=gbit * GBIT_TO_GBPS,
        achieved_busbw_gbps=0.90 * gbit * GBIT_TO_GBPS, alpha_s=50e-6, nics_per_node=nics,
        source="line rate IEEE 802.3; 90 % = TCP/IPv4 goodput at MTU 1500 (1448/1538 = 94 %) less "
               "socket overhead (hand derivation, shardtune/catalog/interconnects.py)",
        note="one NIC per node; NCCL falls back to its socket transport (no RDMA)",
    )


INTERCONNECTS: dict[str, Interconnect] = {
    # ---- inside a node (per GPU) ----
    "nvlink-h100": Interconnect(
        "nvlink-h100", "intra", 450.0, 370.0, 2e-6, 0,
        source="NVIDIA nccl-tests issue #212 (S. Jeaugey, NVIDIA): H100 NVLink4 450 GB/s line rate, "
               "~370 GB/s effective busbw with ring / non-allreduce collectives (~480 GB/s allreduce "
               "with NVLink SHARP)",
        note="also H200 (same NVLink4 / NVSwitch3); ring value used, NVLS all-reduce is faster",
    ),
    "nvlink-a100": Interconnect(
        "nvlink-a100", "intra", 300.0, 230.0, 3e-6, 0,
        source="A100 NVLink3: 600 GB/s bidirectional = 300 GB/s per direction (NVIDIA A100 "
               "datasheet); nccl-tests all_reduce busbw 230.8 GB/s on one p4dn (8×A100) node "
               "(NVIDIA/nccl issue #527), ~200-208 GB/s reported in nccl-tests issues #149, #178",
    ),
    "pcie-gen4": Interconnect(
        "pcie-gen4", "intra", 32.0, 22.0, 5e-6, 0,
        source="PCIe 4.0 x16: 16 GT/s × 16 lanes × 128/130 = 31.5 GB/s per direction (PCI-SIG); "
               "~22 GB/s achieved busbw between GPUs through the host bridge is typical "
               "(NVIDIA/nccl issue #1639: 28-35 GB/s even on Gen5 8-GPU boxes, CPU/memory-bound)",
        note="GPUs without NVLink; depends strongly on the PCIe switch topology",
    ),
    "pcie-gen5": Interconnect(
        "pcie-gen5", "intra", 64.0, 35.0, 5e-6, 0,
        source="PCIe 5.0 x16: 63 GB/s per direction (PCI-SIG); NVIDIA/nccl issue #1639: 8×RTX 5090 "
               "on Gen5 all_reduce busbw 28 GB/s (8 GPUs), 35 GB/s (4 GPUs)",
    ),
    # ---- between nodes (per NIC) ----
    "ib-ndr-400": Interconnect(
        "ib-ndr-400", "inter", 50.0, 47.0, 5e-6, 8,
        source="InfiniBand NDR 400 Gb/s = 50 GB/s per ConnectX-7 NIC; NVIDIA/nccl-tests issue #290 "
               "(A. Laddy, NVIDIA): 'For NDR @ 400Gbps you should see 46-48GB/s per NIC'",
        note="DGX/HGX H100: 8 NICs per node, one per GPU",
    ),
    "ib-hdr-200": Interconnect(
        "ib-hdr-200", "inter", 25.0, 23.5, 5e-6, 8,
        source="InfiniBand HDR 200 Gb/s = 25 GB/s per ConnectX-6 NIC; same 94 % efficiency as NDR's "
               "47/50 (NVIDIA/nccl-tests issue #290)",
        note="DGX A100: 8 compute NICs per node",
    ),
    "roce-400": Interconnect(
        "roce-400", "inter", 50.0, 44.0, 8e-6, 8,
        source="RoCE v2 at 400 Gb/s = 50 GB/s per NIC; ~88 % achieved (lossless fabric with PFC/ECN "
               "tuned; NVIDIA/nccl-tests issue #367 discusses 8×400G RoCE clusters) — a few % below IB",
        note="needs a tuned lossless Ethernet fabric; untuned RoCE is much slower",
    ),
    "efa": Interconnect(
        "efa", "inter", 12.5, 10.0, 15e-6, 32,
        source="AWS p5.48xlarge: 3200 Gb/s EFAv2 = 32 × 100 Gb/s interfaces (AWS EC2 P5 docs); "
               "NVIDIA/nccl issue #235 (S. Jeaugey): 80 Gb/s of 100 Gb/s EFA on 2 nodes = 80 %",
        note="p4d: 4 × 100 Gb/s — use --nics-per-node 4",
    ),
    "eth-100g": _eth("eth-100g", 100.0, 1),
    "eth-25g": _eth("eth-25g", 25.0, 1),
    "eth-10g": _eth("eth-10g", 10.0, 1),
}
# Aliases users type.
ALIASES = {
    "nvlink-h200": "nvlink-h100", "nvlink": "nvlink-h100", "ib-ndr": "ib-ndr-400", "ndr": "ib-ndr-400",
    "ib-hdr": "ib-hdr-200", "hdr": "ib-hdr-200", "roce": "roce-400", "ib": "ib-ndr-400",
    "10gbe": "eth-10g", "25gbe": "eth-25g", "100gbe": "eth-100g", "pcie": "pcie-gen4",
}


def get_interconnect(name: str, scope: str | None = None) -> Interconnect:
    """The catalogue entry for `name` (aliases accepted); UserError naming the choices otherwise."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in INTERCONNECTS:
        raise UserError(
            f"unknown interconnect {name!r}{suggest(key, INTERCONNECTS)}; choose one of "
            f"{', '.join(INTERCONNECTS)}"
        )
    link = INTERCONNECTS[key]
    if scope is not None and link.scope != scope:
        want = "a link between nodes (--interconnect)" if scope == "inter" else "a link inside a node (--intra-node)"
        choices = ", ".join(n for n, v in INTERCONNECTS.items() if v.scope == scope)
        raise UserError(f"{name!r} is not {want}; choose one of {choices}")
    return link


def default_intra_node(gpu_name: str | None) -> str:
    """The usual link inside a node for a GPU name (SXM boards have NVLink, PCIe cards do not)."""
    g = (gpu_name or "").lower()
    if "pcie" in g or g.startswith(("l4", "l40", "rtx", "a10g", "a10-", "a6000", "t4")):
        return "pcie-gen4"
    if "a100" in g:
        return "nvlink-a100"
    return "nvlink-h100"
