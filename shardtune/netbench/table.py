"""`shardtune bench comm`'s table: nccl-tests' columns for a profile, then its fitted links. Imports no torch."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table


def fmt_size(n: int) -> str:
    """A message size in binary units: 4 KiB, 64 MiB."""
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:g} {unit}"
    return f"{n} B"


def print_table(prof: dict, file=None) -> None:
    """nccl-tests' columns: size, time, algbw, busbw (GB = 10^9 B), then the fitted links."""
    t = Table(title=f"{prof['backend']} · {prof['world_size']} ranks · {prof['num_nodes']} host(s) · scope "
                    f"{prof['scope']}")
    for col in ("collective", "size", "time (µs)", "algbw (GB/s)", "busbw (GB/s)"):
        t.add_column(col, justify="left" if col == "collective" else "right")
    for r in prof["results"]:
        t.add_row(r["collective"], fmt_size(r["size_bytes"]), f"{r['time_s'] * 1e6:,.1f}",
                  f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}")
    console = Console(file=file or sys.stdout)
    console.print(t)
    for kind, link in prof["links"].items():
        console.print(f"{kind}: busbw {link['busbw_gbps']:.3f} GB/s, α {link['alpha_s'] * 1e6:.1f} µs per ring step")


def progress_line(row: dict) -> str:
    """The progress bar's description while a size runs: collective, size, busbw."""
    return f"{row['collective']} {fmt_size(row['size_bytes'])}: {row['busbw_gbps']:.3f} GB/s"
