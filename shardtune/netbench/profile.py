"""Network profile: what `shardtune bench comm` measured, in the form `shardtune plan` reads.

Imports no torch. Definitions follow NVIDIA nccl-tests doc/PERFORMANCE.md: algbw = S / t with S
the whole buffer; busbw = algbw × 2(n−1)/n for all-reduce, × (n−1)/n for all-gather and
reduce-scatter, × 1 for broadcast — the per-rank link bandwidth a ring achieved.
"""
from __future__ import annotations

from shardtune.plan.ring import KINDS, bus_factor, ring_steps

PROFILE_FORMAT = 1


def result_row(kind: str, size_bytes: int, n: int, time_s: float) -> dict:
    """One measurement with its algbw and busbw in GB/s (10^9 B/s)."""
    algbw = size_bytes / time_s / 1e9
    return {"collective": kind, "size_bytes": int(size_bytes), "time_s": time_s,
            "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(kind, n)}


def fit_links(rows: list[dict], n: int) -> dict[str, dict]:
    """Per collective: α and busbw of t(S) = steps·α + factor·S / busbw through the smallest and
    the largest message (the two-point α-β fit, exact at both ends).

    The fitted busbw is the marginal bandwidth, slightly above nccl-tests' large-message busbw
    (which still contains steps·α); that one is kept as `busbw_at_largest_gbps`. With one size,
    or when noise makes the marginal cost non-positive, busbw is the largest message's and α 0.
    """
    links = {}
    for kind in KINDS:
        pts = sorted((r for r in rows if r["collective"] == kind), key=lambda r: r["size_bytes"])
        if not pts:
            continue
        big, small = pts[-1], pts[0]
        steps, factor = max(1, ring_steps(kind, n)), bus_factor(kind, n)
        busbw, alpha = big["busbw_gbps"] * 1e9, 0.0
        if big["size_bytes"] > small["size_bytes"] and big["time_s"] > small["time_s"]:
            busbw = factor * (big["size_bytes"] - small["size_bytes"]) / (big["time_s"] - small["time_s"])
            alpha = max(0.0, small["time_s"] - factor * small["size_bytes"] / busbw) / steps
        links[kind] = {"busbw_gbps": busbw / 1e9, "alpha_s": alpha, "busbw_at_largest_gbps": big["busbw_gbps"],
                       "from_sizes_bytes": [small["size_bytes"], big["size_bytes"]]}
    return links


def build_profile(rows: list[dict], n: int, backend: str, hostnames: list[str], scope: str | None,
                  extra: dict | None = None) -> dict:
    """The profile JSON: raw rows, fitted links, and where it was measured."""
    num_nodes = len(set(hostnames)) or 1
    return {
        "format": PROFILE_FORMAT,
        "tool": "shardtune bench comm",
        "backend": backend,
        "world_size": n,
        "num_nodes": num_nodes,
        "scope": scope or ("inter" if num_nodes > 1 else "intra"),
        "definitions": "nccl-tests doc/PERFORMANCE.md: algbw = size/time; busbw = algbw × "
                       "2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter); GB = 1e9 B",
        "results": rows,
        "links": fit_links(rows, n),
        **(extra or {}),
    }
