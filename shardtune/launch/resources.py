"""CPUs and host memory per node for the scheduler: SLURM's `--cpus-per-task` / `--mem`, the
PyTorchJob's `resources.requests`.

Host memory per node = the planner's host-resident bytes (`shardtune.plan.plan`: the offloaded
states of `parallel.offload`, `cpu_offload_bytes_per_node`; on a CPU run, every rank's whole
peak) + a per-process allowance for what the planner does not model on the host (torch and the
CUDA runtime, pinned staging buffers, DataLoader workers, the checkpoint writer) + /dev/shm on
Kubernetes, where a memory-backed emptyDir counts against the pod's memory. The derivation and
its numbers are in docs/multinode.md ("CPUs and memory").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shardtune.config import RunConfig
from shardtune.errors import UserError
from shardtune.plan.api import plan

GIB = 2**30
CPUS_PER_PROCESS = 8  # the smallest common share: p4d / ND H100 v5 have 12 per GPU, DGX H100 14, p5 24
PROCESS_HOST_BYTES = 8 * GIB  # per trainer process, beside what the planner counts (module doc)
SHM_BYTES_PER_PROCESS = 2 * GIB  # /dev/shm per process: NCCL's SHM transport and DataLoader batches


@dataclass(frozen=True)
class NodeResources:
    cpus: int
    planner_bytes: int  # host-resident bytes the planner counts per node (0: none, or no estimate)
    mem_bytes: int  # planner_bytes + the per-process allowance
    shm_bytes: int
    note: str | None = None  # why there is no planner figure

    @property
    def mem_gib(self) -> int:
        return math.ceil(self.mem_bytes / GIB)

    @property
    def shm_gib(self) -> int:
        return math.ceil(self.shm_bytes / GIB)


def planner_host_bytes(cfg: RunConfig, nodes: int, procs_per_node: int) -> int:
    """The planner's host-resident bytes per node: offloaded states, or on a CPU (gloo) run each
    rank's whole predicted peak (there the "device" is the host)."""
    row = plan(gpus=nodes * procs_per_node, nodes=nodes, gpus_per_node=procs_per_node,
               strategies=[cfg.parallel.strategy], **cfg.plan_inputs()).strategies[0]
    if cfg.train.backend == "gloo":
        return row.memory.total * procs_per_node
    return row.cpu_offload_bytes_per_node


def node_resources(cfg: RunConfig, nodes: int, procs_per_node: int, cpus: int | None = None) -> NodeResources:
    """What one node of the job asks the scheduler for (module doc)."""
    note = None
    try:
        planned = planner_host_bytes(cfg, nodes, procs_per_node)
    except (UserError, KeyError, ValueError) as e:  # a model outside the planner's families
        planned, note = 0, f"no planner estimate of host memory for this recipe ({e})"
    return NodeResources(cpus=cpus or CPUS_PER_PROCESS * procs_per_node, planner_bytes=planned,
                         mem_bytes=planned + PROCESS_HOST_BYTES * procs_per_node,
                         shm_bytes=SHM_BYTES_PER_PROCESS * procs_per_node, note=note)


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def slurm_mem_bytes(value: str) -> int:
    """Bytes in a Slurm --mem value (sbatch(1): an integer, default unit megabytes, suffix K, M, G, T)."""
    v = value.strip().upper()
    unit = _UNITS.get(v[-1:], None)
    digits = v[:-1] if unit else v
    if not digits.isdigit() or int(digits) == 0:
        raise UserError(f"--mem {value!r} is not a Slurm memory size (e.g. 512G, 200000M)")
    return int(digits) * (unit or _UNITS["M"])
