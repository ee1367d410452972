"""What a multi-node launch needs, validated once before any renderer writes a line.

`LaunchSpec` holds the user's values; the renderers (`torchrun.py`, `slurm.py`, `k8s.py`) only
format them. Values that end up in a shell script are quoted there with `shlex.quote`; values that
end up where no quoting exists (`#SBATCH` lines, Kubernetes object names) are checked here against
what those parsers accept, and anything else is a one-line `UserError`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from shardtune.errors import UserError, suggest

INTERCONNECTS = ("nvlink", "ib", "roce", "efa", "eth")

# sbatch reads `#SBATCH` lines itself (not through bash): quoting there is sbatch's own, and a
# newline ends the option. Only characters that need no quoting at all are accepted.
_SBATCH_WORD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
# %j (job id), %x (job name), %N (node) are sbatch filename patterns, kept on purpose.
_SBATCH_PATH = re.compile(r"^[A-Za-z0-9_./%+-]+$")
# Slurm --time formats (sbatch(1), "-t, --time"): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
# Kubernetes object names: RFC 1123 DNS label (lowercase alphanumerics and '-', at most 63).
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# An interface name as Linux accepts it (IFNAMSIZ 16 incl. NUL); NCCL takes comma lists of them.
_IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")
_HOST = re.compile(r"^[A-Za-z0-9_.:\[\]-]+$")
# OCI reference: [registry[:port]/]path[:tag][@sha256:digest]
_IMAGE = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*"
                    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?")
# Kubernetes resource names (qualified: [prefix/]name) and quantities (binary or decimal suffix).
_K8S_RESOURCE = re.compile(r"(?:[a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_K8S_QUANTITY = re.compile(r"[0-9]+(?:Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?")
_HCA = re.compile(r"[=^]?[A-Za-z0-9_]+(?::[0-9]+)?(?:,[A-Za-z0-9_]+(?::[0-9]+)?)*")


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a launcher renders. `recipe` and `overrides` are passed to the trainer verbatim."""

    recipe: str
    overrides: tuple[str, ...] = ()
    nodes: int = 1
    gpus_per_node: int = 8
    interconnect: str = "ib"
    ifname: str | None = None  # the training network's interface on every node (eth0, ens5)
    ib_hca: str | None = None  # NCCL_IB_HCA value (mlx5_0,mlx5_1 or a prefix)
    job_name: str | None = None  # None: "shardtune" (SLURM, torchrun), a unique name (k8s)
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    image: str | None = None
    max_restarts: int = 0
    rdzv_host: str | None = None
    rdzv_port: int = 29500
    run_id: str | None = None
    venv: str | None = None  # activated on each node before torchrun
    container_image: str | None = None  # SLURM: srun --container-image (pyxis) instead of a venv
    cpus_per_task: int | None = None
    log: str | None = None  # sbatch --output pattern (stdout+stderr of the job)
    checkpoint_grace_s: int = 300  # SLURM: signal this long before the time limit
    pvc: str | None = None  # k8s: shared ReadWriteMany claim for checkpoints
    checkpoint_mount: str = "/checkpoints"
    elastic: tuple[int, int] | None = None  # k8s: (min, max) nodes
    efa_devices: int | None = None  # k8s + efa: vpc.amazonaws.com/efa per pod
    mem: str | None = None  # SLURM --mem (default: the planner's host figure, launch/resources.py)
    exclusive: bool = False  # SLURM: whole nodes (--exclusive, --mem=0)
    cpus: int | None = None  # k8s: cpu request per pod (default: launch/resources.py)
    memory: str | None = None  # k8s: memory request per pod, a Kubernetes quantity
    rdma_resource: str | None = None  # k8s + ib/roce: extended resource of the RDMA device plugin; "none": omit
    tolerations: tuple[str, ...] = ()  # k8s: --toleration KEY[=VALUE][:EFFECT]
    node_selector: tuple[str, ...] = ()  # k8s: --node-selector KEY=VALUE
    strict: bool = False  # refuse (not warn about) recipe paths the nodes will not see


def normalize_interconnect(name: str) -> str:
    v = str(name).strip().lower()
    aliases = {"infiniband": "ib", "rocev2": "roce", "roce-v2": "roce", "tcp": "eth", "ethernet": "eth",
               "eth-10g": "eth", "eth-100g": "eth", "nvl": "nvlink"}
    v = aliases.get(v, v)
    if v not in INTERCONNECTS:
        raise UserError(f"unknown interconnect {name!r}{suggest(v, INTERCONNECTS)}; choose one of "
                        f"{', '.join(INTERCONNECTS)}")
    return v


def parse_slurm_time_s(value: str) -> int:
    """Seconds in a Slurm time limit (sbatch(1) `--time`: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S)."""
    m = _SLURM_TIME.match(value.strip())
    if not m:
        raise UserError(f"--time {value!r} is not a Slurm time (e.g. 90, 4:00:00, 2-00:00:00)")
    days, a, b, c = m.groups()
    a, b, c = int(a), (int(b) if b else None), (int(c) if c else None)
    if days is not None:  # D-H, D-H:M, D-H:M:S
        return int(days) * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:  # H:M:S
        return a * 3600 + b * 60 + c
    if b is not None:  # M:S
        return a * 60 + b
    return a * 60  # M


def _check(pattern: re.Pattern, option: str, value: str, allowed: str) -> str:
    if not pattern.fullmatch(value):
        raise UserError(f"{option} {value!r} has characters a #SBATCH line cannot carry; use {allowed}")
    return value


def check_sbatch_word(option: str, value: str) -> str:
    return _check(_SBATCH_WORD, option, value, "letters, digits, '.', '_', '+', '-'")


def check_sbatch_path(option: str, value: str) -> str:
    return _check(_SBATCH_PATH, option, value, "letters, digits and . _ / % + -")


def check_k8s_name(option: str, value: str, letter_first: bool = False) -> str:
    """An RFC 1123 label; `letter_first`: an RFC 1035 label, as the training operator's webhook wants
    a PyTorchJob's name (NameIsDNS1035Label)."""
    if len(value) > 63 or not _K8S_NAME.fullmatch(value) or (letter_first and not value[0].isalpha()):
        first = ", starting with a letter" if letter_first else ""
        raise UserError(f"{option} {value!r} is not a Kubernetes name; use lowercase letters, digits and '-'{first} "
                        "(at most 63)")
    return value


def check_ifname(value: str) -> str:
    if not all(_IFNAME.fullmatch(p) for p in value.split(",")):
        raise UserError(f"--ifname {value!r} is not an interface name (e.g. eth0, ens5, ib0); list several with commas")
    return value


def check_host(option: str, value: str) -> str:
    if not _HOST.fullmatch(value):
        raise UserError(f"{option} {value!r} is not a host name or address")
    return value


def check_image(value: str) -> str:
    if not _IMAGE.fullmatch(value):
        raise UserError(f"--image {value!r} is not a container image reference (e.g. ghcr.io/org/shardtune:1.0)")
    return value


def check_ib_hca(value: str) -> str:
    if not _HCA.fullmatch(value):
        raise UserError(f"--ib-hca {value!r} is not an NCCL_IB_HCA list (e.g. mlx5_0,mlx5_1 or =mlx5_0:1)")
    return value


MAX_NODES, MAX_GPUS_PER_NODE = 100_000, 1024  # beyond any cluster; a typo's extra digits stop here
# sbatch(1) --signal: the largest time it accepts; torchrun and k8s share the grace (SIGTERM → SIGKILL)
MAX_GRACE_S = 65535
_MAX_SLURM_MINUTES = 2**32 - 2  # Slurm keeps a time limit as 32-bit minutes (2^32 - 1 is INFINITE)


def _has_control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def validate(spec: LaunchSpec) -> LaunchSpec:
    """Checks every launcher shares; returns the spec with the interconnect name normalised."""
    if not 1 <= spec.nodes <= MAX_NODES:
        raise UserError(f"--nodes {spec.nodes}: give 1 to {MAX_NODES:,} nodes")
    if not 1 <= spec.gpus_per_node <= MAX_GPUS_PER_NODE:
        raise UserError(f"--gpus-per-node {spec.gpus_per_node}: give 1 to {MAX_GPUS_PER_NODE} processes per node")
    if not 0 <= spec.max_restarts <= 1000:  # as `shardtune train`'s: more is a typo
        raise UserError(f"--max-restarts {spec.max_restarts}: give 0 to 1000")
    if spec.elastic is not None and not 1 <= spec.elastic[0] <= spec.elastic[1] <= MAX_NODES:
        raise UserError(f"--elastic {spec.elastic[0]}:{spec.elastic[1]}: need 1 <= MIN <= MAX <= {MAX_NODES:,} nodes")
    if not 0 < spec.checkpoint_grace_s <= MAX_GRACE_S:
        raise UserError(f"--checkpoint-grace-s {spec.checkpoint_grace_s}: give 1..{MAX_GRACE_S} seconds")
    if spec.cpus_per_task is not None and spec.cpus_per_task < 1:
        raise UserError(f"--cpus-per-task {spec.cpus_per_task}: give at least 1 CPU")
    if spec.cpus is not None and spec.cpus < 1:
        raise UserError(f"--cpus {spec.cpus}: give at least 1 CPU")
    if spec.memory is not None and not _K8S_QUANTITY.fullmatch(spec.memory):
        raise UserError(f"--memory {spec.memory!r} is not a Kubernetes quantity (e.g. 512Gi)")
    if spec.rdma_resource is not None and spec.rdma_resource != "none" and (
            len(spec.rdma_resource) > 253 or not _K8S_RESOURCE.fullmatch(spec.rdma_resource)):
        raise UserError(f"--rdma-resource {spec.rdma_resource!r} is not a Kubernetes resource name (e.g. "
                        "rdma/rdma_shared_device_a), or none")
    if spec.mem is not None:
        from shardtune.launch.resources import slurm_mem_bytes  # noqa: PLC0415 spec.py stays free of the config (pydantic): only --mem needs it

        slurm_mem_bytes(spec.mem)
    if spec.exclusive and spec.mem:
        raise UserError("--exclusive takes each node's whole memory (--mem=0); give --mem or --exclusive, not both")
    if spec.time is not None and parse_slurm_time_s(spec.time) // 60 > _MAX_SLURM_MINUTES:
        raise UserError(f"--time {spec.time!r} is beyond what Slurm can hold; give e.g. 2-00:00:00")
    # (the recipe path is an existing file, passed quoted and verbatim: tests/unit/test_launch.py HOSTILE)
    for option, value in (("--venv", spec.venv), ("--checkpoint-mount", spec.checkpoint_mount)):
        if value is not None and _has_control(value):
            raise UserError(f"{option} {value!r} holds a line break or control character; give a plain path")
    if ".." in spec.checkpoint_mount.split("/"):
        raise UserError(f"--checkpoint-mount {spec.checkpoint_mount!r}: Kubernetes refuses '..' in a mount path; "
                        "give the absolute path itself")
    if not 1 <= spec.rdzv_port <= 65535:
        raise UserError(f"--rdzv-port {spec.rdzv_port} is not a TCP port (1-65535)")
    ic = normalize_interconnect(spec.interconnect)
    if ic == "nvlink" and spec.nodes > 1:
        raise UserError("--interconnect nvlink is one node's GPUs; for several nodes choose ib, roce, efa or eth")
    if spec.ifname:
        check_ifname(spec.ifname)
    if spec.rdzv_host:
        check_host("--rdzv-host", spec.rdzv_host)
    if spec.job_name is not None:
        check_sbatch_word("--job-name", spec.job_name)
    if spec.image:
        check_image(spec.image)
    if spec.ib_hca:
        check_ib_hca(spec.ib_hca)
    if spec.run_id:
        check_sbatch_word("--run-id", spec.run_id)
    for ov in spec.overrides:
        if "=" not in ov:
            raise UserError(f"override {ov!r} is not key.path=value")
    return replace(spec, interconnect=ic)
