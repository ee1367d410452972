"""`shardtune launch torchrun|slurm|k8s` and `shardtune doctor`. Imports no torch at module level.

The layout options (--strategy, --tp, --cp, --ep, --pp) are the trainer's flags marked `launch` in
config/flags.py `TRAIN_FLAGS` (`flag_options`): each becomes its recipe-key override, checked here and
passed to every node's trainer; a new degree is a row there, not an option here."""
from __future__ import annotations

import os
import sys

import typer

from shardtune.config.flags import LAUNCH_FLAGS, flag_options, flag_overrides
from shardtune.errors import UserError
from shardtune.launch.checks import check_layout, interconnect_help, resolve_interconnect
from shardtune.launch.checks import parse_elastic as _parse_elastic
from shardtune.launch.emit import emit as _emit
from shardtune.launch.emit import node_resources_notes as _node_resources

launch_app = typer.Typer(no_args_is_help=True, help="Write what a cluster needs to run a recipe on several nodes.")

# Options shared by the three launchers (typer has no option groups: declared once, reused).
_RECIPE = typer.Argument(..., metavar="RECIPE",
                         help="YAML recipe (must exist on every node at this path; k8s embeds it).")
_OVERRIDES = typer.Argument(None, metavar="KEY=VALUE",
                            help="Recipe overrides key.path=value, passed to the trainer.")
_NODES = typer.Option(1, "--nodes", metavar="N", help="Number of nodes.")
_GPUS = typer.Option(8, "--gpus-per-node", metavar="N", help="GPUs (trainer processes) per node.")

_IC = typer.Option("ib", "--interconnect", metavar="NAME", help=interconnect_help())
_IFNAME = typer.Option(None, "--ifname", metavar="IFACE",
                       help="Interface of the training network on every node (eth0, ens5): pins "
                            "NCCL and gloo sockets.")
_HCA = typer.Option(None, "--ib-hca", metavar="LIST",
                    help="NCCL_IB_HCA: IB/RoCE devices NCCL may use (e.g. mlx5_0,mlx5_1).")
_LINK = typer.Option(None, "--link", metavar="NAME",
                     help="Catalogue link for the communication estimate (e.g. eth-100g, "
                          "ib-hdr-200); default from --interconnect.")
_JOB = typer.Option(None, "--job-name", "--name", metavar="NAME",
                    help="Job name (SLURM job, Kubernetes objects, rendezvous id). Default: shardtune; on "
                         "Kubernetes the recipe's name plus a random suffix, so two jobs never collide.")
_STRICT = typer.Option(False, "--strict",
                       help="Refuse (exit 2) instead of warning when a recipe path is relative or missing "
                            "here (k8s: not on the claim).")
_OUT = typer.Option(None, "-o", "--output", metavar="FILE", help="Write here instead of printing to stdout.")
_RESTARTS = typer.Option(0, "--max-restarts", metavar="N",
                         help="torchrun restarts of the worker group after a failure.")
_GRACE = typer.Option(300, "--checkpoint-grace-s", metavar="SECONDS",
                      help="Seconds between SIGTERM and SIGKILL (SLURM: signal this "
                           "long before --time).")


def _build(recipe: str, overrides: list[str] | None, flags: dict, **kw):
    """Validate the recipe (as the trainer will see it) and the launch options; `flags` (--tp, --ep, ...)
    are their overrides (parallel.ep=N, ...) after the user's, which the nodes' trainers get too."""
    from shardtune.config import load_recipe
    from shardtune.launch.spec import LaunchSpec, validate

    if extra := flag_overrides(**flags):
        overrides = [*(overrides or ()), *extra]
    cfg = load_recipe(recipe, tuple(overrides or ()))
    kw["interconnect"], link = resolve_interconnect(kw["interconnect"], kw.pop("link", None))
    # Absolute: the script runs on other nodes, from whatever folder sbatch or the user starts it in.
    spec = validate(LaunchSpec(recipe=os.path.abspath(recipe), overrides=tuple(overrides or ()), **kw))
    # the trainer checks its layout on every node (the same Layout, its placement rule included); a bad
    # hsdp shard size, tp or cp is refused here, before a script is written (an elastic job may run at
    # any node count from MIN to MAX)
    lo, hi = spec.elastic or (spec.nodes, spec.nodes)
    for nodes in range(max(lo, 1), hi + 1):
        check_layout(cfg, nodes, spec.gpus_per_node)
    return cfg, spec, link


@launch_app.command("torchrun")
@flag_options(LAUNCH_FLAGS)
def torchrun_cmd(
    recipe: str = _RECIPE, overrides: list[str] | None = _OVERRIDES,
    nodes: int = _NODES, gpus_per_node: int = _GPUS, interconnect: str = _IC, ifname: str | None = _IFNAME,
    ib_hca: str | None = _HCA, link: str | None = _LINK, job_name: str = _JOB, output: str | None = _OUT,
    max_restarts: int = _RESTARTS, checkpoint_grace_s: int = _GRACE, strict: bool = _STRICT,
    rdzv_host: str | None = typer.Option(None, "--rdzv-host", metavar="HOST",
                                         help="Address of the node hosting the c10d rendezvous "
                                              "(needed for >1 node)."),
    rdzv_port: int = typer.Option(29500, "--rdzv-port", metavar="PORT", help="Rendezvous TCP port."),
    run_id: str | None = typer.Option(None, "--run-id", metavar="ID",
                                      help="Rendezvous id (default: the job name); unique per "
                                           "concurrent job."),
    venv: str | None = typer.Option(None, "--venv", metavar="DIR",
                                    help="Virtual environment to activate on each node."),
    **flags,
) -> None:
    """A script to run unchanged on every node: one torchrun agent, c10d rendezvous."""
    from shardtune.launch.torchrun import render_torchrun

    cfg, spec, link = _build(recipe, overrides, flags, nodes=nodes, gpus_per_node=gpus_per_node,
                             interconnect=interconnect, link=link,
                             ifname=ifname, ib_hca=ib_hca, job_name=job_name, max_restarts=max_restarts,
                             checkpoint_grace_s=checkpoint_grace_s, rdzv_host=rdzv_host, rdzv_port=rdzv_port,
                             run_id=run_id, venv=venv)
    from shardtune.launch.paths import check_node_paths

    notes = check_node_paths(cfg, strict)
    _emit(render_torchrun(spec), output, cfg, spec, link, executable=True, notes=notes)


@launch_app.command("slurm")
@flag_options(LAUNCH_FLAGS)
def slurm_cmd(
    recipe: str = _RECIPE, overrides: list[str] | None = _OVERRIDES,
    nodes: int = _NODES, gpus_per_node: int = _GPUS, interconnect: str = _IC, ifname: str | None = _IFNAME,
    ib_hca: str | None = _HCA, link: str | None = _LINK, job_name: str = _JOB, output: str | None = _OUT,
    max_restarts: int = _RESTARTS, checkpoint_grace_s: int = _GRACE,
    partition: str | None = typer.Option(None, "--partition", metavar="NAME", help="SLURM partition."),
    account: str | None = typer.Option(None, "--account", metavar="NAME", help="SLURM account."),
    time: str | None = typer.Option(None, "--time", metavar="LIMIT", help="Time limit (e.g. 4:00:00, 2-00:00:00)."),
    cpus_per_task: int | None = typer.Option(None, "--cpus-per-task", metavar="N",
                                             help="CPUs for each node's torchrun agent and "
                                                  "its workers (default 8 per process)."),
    mem: str | None = typer.Option(None, "--mem", metavar="SIZE",
                                   help="Memory per node, as sbatch takes it (512G); default: the planner's "
                                        "host figure + 8 GiB per process."),
    exclusive: bool = typer.Option(False, "--exclusive",
                                   help="Whole nodes: every CPU and all memory of each (--mem=0)."),
    strict: bool = _STRICT,
    log: str | None = typer.Option(None, "--log", metavar="PATTERN",
                                   help="sbatch --output pattern (default %x-%j.out)."),
    rdzv_port: int = typer.Option(29500, "--rdzv-port", metavar="PORT", help="Rendezvous TCP port on the first node."),
    venv: str | None = typer.Option(None, "--venv", metavar="DIR",
                                    help="Virtual environment to activate on each node."),
    container_image: str | None = typer.Option(None, "--container-image", metavar="IMAGE",
                                               help="Run each node's torchrun in this image (pyxis/enroot)."),
    **flags,
) -> None:
    """An sbatch script: srun starts one torchrun per node; checkpoint and requeue before the time limit."""
    from shardtune.launch.slurm import environment_notes, render_slurm

    cfg, spec, link = _build(recipe, overrides, flags, nodes=nodes, gpus_per_node=gpus_per_node,
                             interconnect=interconnect, link=link,
                             ifname=ifname, ib_hca=ib_hca, job_name=job_name, max_restarts=max_restarts,
                             checkpoint_grace_s=checkpoint_grace_s, partition=partition, account=account, time=time,
                             cpus_per_task=cpus_per_task, log=log, rdzv_port=rdzv_port, venv=venv, mem=mem,
                             exclusive=exclusive, container_image=container_image)
    from shardtune.launch.paths import check_node_paths

    notes = check_node_paths(cfg, strict)
    res, res_notes = _node_resources(cfg, spec)
    _emit(render_slurm(spec, res), output, cfg, spec, link, executable=False,
          notes=notes + res_notes + environment_notes(spec))


@launch_app.command("k8s")
@flag_options(LAUNCH_FLAGS)
def k8s_cmd(
    recipe: str = _RECIPE, overrides: list[str] | None = _OVERRIDES,
    nodes: int = _NODES, gpus_per_node: int = _GPUS, interconnect: str = _IC, ifname: str | None = _IFNAME,
    ib_hca: str | None = _HCA, link: str | None = _LINK, job_name: str = _JOB, output: str | None = _OUT,
    max_restarts: int = _RESTARTS, checkpoint_grace_s: int = _GRACE,
    image: str | None = typer.Option(None, "--image", metavar="IMAGE",
                                     help="Container image with shardtune installed."),
    pvc: str | None = typer.Option(None, "--pvc", metavar="CLAIM",
                                   help="Shared ReadWriteMany PersistentVolumeClaim for checkpoints and "
                                        "inputs (default shardtune-checkpoints)."),
    checkpoint_mount: str = typer.Option("/checkpoints", "--checkpoint-mount", metavar="PATH",
                                         help="Where the claim is mounted; "
                                              "the run folder goes under it."),
    elastic: str | None = typer.Option(None, "--elastic", metavar="MIN:MAX",
                                       help="MIN:MAX nodes: an elastic job (c10d rendezvous, "
                                            "workers only)."),
    efa_devices: int | None = typer.Option(None, "--efa-devices", metavar="N",
                                           help="With --interconnect efa: EFA interfaces per "
                                                "pod (p5 32, p4d 4)."),
    cpus: int | None = typer.Option(None, "--cpus", metavar="N", help="CPU request per pod (default 8 per process)."),
    memory: str | None = typer.Option(None, "--memory", metavar="QTY",
                                      help="Memory request per pod (512Gi); default: the planner's host figure "
                                           "+ 8 GiB per process + /dev/shm."),
    rdma_resource: str | None = typer.Option(None, "--rdma-resource", metavar="NAME",
                                             help="With ib/roce: the RDMA device plugin's resource "
                                                  "(e.g. rdma/rdma_shared_device_a; adds IPC_LOCK); none by default."),
    toleration: list[str] | None = typer.Option(None, "--toleration", metavar="KEY[=VALUE][:EFFECT]",
                                                help="Tolerate a node taint (repeatable)."),
    node_selector: list[str] | None = typer.Option(None, "--node-selector", metavar="KEY=VALUE",
                                                   help="Run only on nodes with this label (repeatable)."),
    strict: bool = _STRICT,
    **flags,
) -> None:
    """A Kubeflow PyTorchJob manifest (plus a ConfigMap with the resolved recipe)."""
    from shardtune.launch.k8s import render_k8s

    if not checkpoint_mount.startswith("/") or "\n" in checkpoint_mount:
        raise UserError(f"--checkpoint-mount {checkpoint_mount!r} must be an absolute path")
    cfg, spec, link = _build(recipe, overrides, flags, nodes=nodes, gpus_per_node=gpus_per_node,
                             interconnect=interconnect, link=link,
                             ifname=ifname, ib_hca=ib_hca, job_name=job_name, max_restarts=max_restarts,
                             checkpoint_grace_s=checkpoint_grace_s, image=image, pvc=pvc,
                             checkpoint_mount=checkpoint_mount, elastic=_parse_elastic(elastic),
                             efa_devices=efa_devices, cpus=cpus, memory=memory, rdma_resource=rdma_resource,
                             tolerations=tuple(toleration or ()), node_selector=tuple(node_selector or ()))
    from shardtune.launch.k8s import DEFAULT_PVC, rdma_note
    from shardtune.launch.paths import claim_notes

    notes = claim_notes(cfg, spec.checkpoint_mount, spec.pvc or DEFAULT_PVC, strict)
    res, res_notes = _node_resources(cfg, spec)
    notes += res_notes + ([rdma_note(spec)] if rdma_note(spec) else [])
    _emit(render_k8s(spec, cfg, res), output, cfg, spec, link, executable=False, notes=notes)


def doctor(
    rdzv: str | None = typer.Option(None, "--rdzv", metavar="HOST:PORT", help="HOST:PORT of the rendezvous to check."),
    checkpoint_dir: str | None = typer.Option(None, "--checkpoint-dir", metavar="DIR",
                                              help="Folder checkpoints will be written to."),
) -> None:
    """Check this node: torch / CUDA / NCCL, GPUs, network variables, rendezvous, checkpoint folder."""
    from shardtune.launch.doctor import format_checks, run_doctor

    checks = run_doctor(rdzv, checkpoint_dir)
    print(format_checks(checks))
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        print(f"{len(failed)} problem(s) would stop a run: see FAIL above", file=sys.stderr)
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(launch_app, name="launch")
    app.command("doctor")(doctor)
