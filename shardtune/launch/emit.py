"""What a launch command prints or writes: its notes and the communication-bound warning on stderr,
then the script or manifest on stdout or into -o FILE; the per-node resources with their note.
Imports no torch."""
from __future__ import annotations

import sys
from pathlib import Path

from shardtune.errors import UserError, check_no_blocking_pipe


def node_resources_notes(cfg, spec):
    """CPUs and memory per node (launch/resources.py), with its note when the planner has no figure."""
    from shardtune.launch.resources import node_resources  # noqa: PLC0415 pydantic and the planner: not at CLI start-up

    res = node_resources(cfg, spec.nodes, spec.gpus_per_node, spec.cpus_per_task or spec.cpus)
    return res, ([f"note: {res.note}; the job asks only for the per-process allowance"] if res.note else [])


def emit(text: str, output: str | None, cfg, spec, link: str | None, executable: bool,
          notes: list[str] = ()) -> None:
    from shardtune.launch.advice import comm_bound_warning  # noqa: PLC0415 pydantic and the planner: not at CLI start-up

    if output is not None:  # a path that cannot take the file is the one line, before any warning
        check_no_blocking_pipe(Path(output), "-o")
    warning = comm_bound_warning(cfg, spec.nodes, spec.gpus_per_node, spec.interconnect, link)
    for line in [*notes, warning] if warning else notes:
        print(line, file=sys.stderr)
    if output is None:
        sys.stdout.write(text)
        return
    path = Path(output)
    try:
        path.write_text(text)
        if executable:
            path.chmod(path.stat().st_mode | 0o111)
    except OSError as e:
        raise UserError(f"cannot write {output!r}: {e.strerror}") from None
    print(f"wrote {output}", file=sys.stderr)
