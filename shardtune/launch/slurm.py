"""Render an sbatch script: one torchrun agent per node (srun), c10d rendezvous on the first node.

Before the time limit Slurm signals the batch shell (`--signal=B:USR1@GRACE`); the script then
sends SIGTERM to the job steps (scancel without --batch/--full leaves the batch shell alone),
torchrun forwards it to the trainer, which saves a checkpoint (issue 4), and once the step has
ended the script requeues the job (`scontrol requeue`, which needs `--requeue`). The requeued job
resumes from the newest complete checkpoint (`checkpoint.resume: auto`).

`#SBATCH` lines are read by sbatch, not by bash: values there are validated (spec.check_*),
everything that bash reads is quoted with shlex.quote. Sources: sbatch(1) (--signal, --requeue,
--time formats), scancel(1), torchrun docs (c10d rendezvous).
"""
from __future__ import annotations

import shlex
from pathlib import Path

from shardtune.errors import UserError
from shardtune.launch.resources import GIB, PROCESS_HOST_BYTES, NodeResources, slurm_mem_bytes
from shardtune.launch.spec import LaunchSpec, check_sbatch_path, check_sbatch_word, parse_slurm_time_s
from shardtune.launch.torchrun import _q, environment_lines, torchrun_args, trainer_args

# sbatch(1) --signal: "Due to the resolution of event handling by Slurm, the signal may be sent
# up to 60 seconds earlier than specified"; 65535 is the largest time it accepts.
_MAX_SIGNAL_TIME_S = 65535


def _task_cpus(spec: LaunchSpec, res: NodeResources | None) -> int | None:
    """CPUs of each node's one task: the user's, else launch/resources.py's (none under --exclusive)."""
    return spec.cpus_per_task or (None if spec.exclusive or res is None else res.cpus)


def _cpu_mem_lines(spec: LaunchSpec, res: NodeResources | None) -> list[str]:
    """CPUs and memory per node: the user's, or launch/resources.py's from the planner; --exclusive
    takes whole nodes (sbatch(1): --mem=0 is all of each node's memory)."""
    cpus = _task_cpus(spec, res)
    lines = [f"#SBATCH --cpus-per-task={int(cpus)}"] if cpus else []
    if spec.exclusive:
        return lines + ["#SBATCH --exclusive", "#SBATCH --mem=0"]
    if spec.mem:
        if res is not None and slurm_mem_bytes(spec.mem) < res.planner_bytes:
            raise UserError(f"--mem {spec.mem} is less than the {res.planner_bytes / GIB:,.1f} GiB per node the "
                            "planner counts on the host for this recipe (offloaded states); give more, or --exclusive")
        return lines + [f"#SBATCH --mem={spec.mem.strip()}"]
    return lines + ([f"#SBATCH --mem={res.mem_gib}G"] if res is not None else [])


def mem_comment(spec: LaunchSpec, res: NodeResources | None) -> list[str]:
    """How the default --mem was derived (launch/resources.py), for the admin who reads the script."""
    if spec.exclusive or spec.mem or res is None:
        return []
    return [f"# --mem={res.mem_gib}G per node = the planner's host-resident bytes "
            f"({res.planner_bytes / GIB:,.1f} GiB: offloaded states, or a CPU run's whole peak) + "
            f"{PROCESS_HOST_BYTES // GIB} GiB for each of the {spec.gpus_per_node} processes (torch and CUDA runtime,",
            "# pinned buffers, DataLoader, checkpoint writer); the GPUs hold the model. docs/multinode.md section 4;",
            "# --mem SIZE or --exclusive to change it."]


def environment_notes(spec: LaunchSpec) -> list[str]:
    """What the nodes must see that the script cannot carry: the environment and the recipe."""
    recipe = Path(spec.recipe).resolve()
    notes = [f"warning: every node reads the recipe at {recipe} (and the run folder and data the recipe names): "
             "they must be on a filesystem the nodes share"]
    if not spec.venv and not spec.container_image:
        notes.append("warning: no --venv or --container-image: each node runs the torchrun and shardtune on the PATH "
                     "the job inherits from the submitting shell; name the environment to be sure")
    return notes

def sbatch_lines(spec: LaunchSpec, res: NodeResources | None = None) -> list[str]:
    """The `#SBATCH` header, every value validated for sbatch's own parser."""
    job = check_sbatch_word("--job-name", spec.job_name or "shardtune")
    lines = [
        f"#SBATCH --job-name={job}",
        f"#SBATCH --nodes={spec.nodes}",
        "#SBATCH --ntasks-per-node=1",  # one torchrun agent per node; it starts the GPU workers
        f"#SBATCH --gpus-per-node={spec.gpus_per_node}",
    ]
    lines += _cpu_mem_lines(spec, res)
    if spec.partition:
        lines.append(f"#SBATCH --partition={check_sbatch_word('--partition', spec.partition)}")
    if spec.account:
        lines.append(f"#SBATCH --account={check_sbatch_word('--account', spec.account)}")
    if spec.time:
        limit_s = parse_slurm_time_s(spec.time)
        if spec.checkpoint_grace_s >= limit_s:
            raise UserError(f"--checkpoint-grace-s {spec.checkpoint_grace_s} is not shorter than --time {spec.time}; "
                            "give a longer time or a shorter grace")
        lines.append(f"#SBATCH --time={spec.time.strip()}")
    if not 0 < spec.checkpoint_grace_s <= _MAX_SIGNAL_TIME_S:  # spec.validate says so first; renderers called alone
        raise UserError(f"--checkpoint-grace-s must be 1..{_MAX_SIGNAL_TIME_S} seconds")
    out = check_sbatch_path("--log", spec.log or "%x-%j.out")
    lines += [
        f"#SBATCH --output={out}",
        f"#SBATCH --signal=B:USR1@{spec.checkpoint_grace_s}",
        "#SBATCH --requeue",
    ]
    return lines


def render_slurm(spec: LaunchSpec, res: NodeResources | None = None) -> str:
    """The sbatch script (see the module docstring); `res`: CPUs and memory per node to ask for."""
    endpoint = '"${RDZV_HOST}:${RDZV_PORT}"'
    torchrun = torchrun_args(spec, "@ENDPOINT@", "@RUNID@")
    # Two values come from Slurm at run time: they stay shell expansions, not quoted literals.
    cmd = _q(torchrun).replace(shlex.quote("@ENDPOINT@"), endpoint).replace(shlex.quote("@RUNID@"), '"${SLURM_JOB_ID}"')
    # srun does not inherit sbatch's --cpus-per-task since Slurm 22.05 (its release notes): repeat it.
    cpus = _task_cpus(spec, res)
    # --exclusive without a count: the step gets every CPU of the node (else srun would give it one)
    cpus = f" --cpus-per-task={int(cpus)}" if cpus else ' --cpus-per-task="$SLURM_CPUS_ON_NODE"' if spec.exclusive \
        else ""
    if spec.container_image:  # pyxis/enroot: the image's environment, the submit folder mounted where it is
        cpus += (f" --container-image={shlex.quote(spec.container_image)}"
                 ' --container-mounts="$SLURM_SUBMIT_DIR" --container-workdir="$SLURM_SUBMIT_DIR"')
    lines = [
        "#!/usr/bin/env bash",
        *sbatch_lines(spec, res),
        "# Generated by `shardtune launch slurm`. Submit with: sbatch THIS_FILE",
        *mem_comment(spec, res),
        *([] if spec.venv or spec.container_image else
          ["# No --venv or --container-image: torchrun and shardtune are the ones on the PATH sbatch exported."]),
        "set -uo pipefail",
        "",
        *environment_lines(spec),
        "# The first node of the allocation hosts the c10d rendezvous store.",
        'RDZV_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        f"RDZV_PORT={int(spec.rdzv_port)}",
        'echo "shardtune: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $SLURM_NNODES nodes, rendezvous '
        '$RDZV_HOST:$RDZV_PORT"',
        "",
        "requeue=0",
        "on_time_limit() {",
        '  echo "shardtune: time limit near: asking the run to checkpoint, then requeueing"',
        "  requeue=1",
        '  scancel --signal=TERM "$SLURM_JOB_ID"  # job steps only: this shell keeps running',
        "}",
        "trap on_time_limit USR1",
        "",
        "srun --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1 --kill-on-bad-exit=1" + cpus + " \\\n  torchrun \\\n  "
        + cmd + " \\\n  " + _q(trainer_args(spec)) + " &",
        "srun_pid=$!",
        "# `wait` returns early when a trapped signal arrives: wait again until srun has exited.",
        'while true; do wait "$srun_pid"; rc=$?; kill -0 "$srun_pid" 2>/dev/null || break; done',
        'if [[ "$requeue" == 1 ]]; then',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)
