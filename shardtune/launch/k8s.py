"""Render a Kubeflow PyTorchJob (kubeflow.org/v1) plus a ConfigMap holding the resolved recipe.

The training operator starts one pod per node and sets torchrun's settings through `PET_*`
environment variables (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, ...; torchrun reads any of its
options from `PET_<OPTION>`), so the container runs plain `torchrun -m shardtune.train RECIPE`.
The recipe travels inside the manifest (a ConfigMap, mounted read-only) with the overrides already
applied, so the image needs shardtune but not the recipe file. Checkpoints go to a shared
ReadWriteMany PersistentVolumeClaim so that a restarted pod, on any node, resumes from them.
/dev/shm is a memory-backed emptyDir: the container runtime's 64 MiB default is too small for
NCCL's shared-memory transport and DataLoader workers; its size (launch/resources.py) counts
against the pod's memory, so the memory request, and the limit beside it, include it. The RDMA
device resource and the IPC_LOCK capability it needs (verbs pin their buffers) are added only for
--rdma-resource NAME: IPC_LOCK is outside the Pod Security Standards' baseline, and a resource the
cluster has no plugin for leaves pods Pending. Without it the pod passes the baseline
(tests/unit/test_launch_cluster.py checks it).

Everything is built as Python dicts and written by a yaml.SafeDumper (the embedded recipe as a
literal block): no string-built YAML.
Sources: Kubeflow training-operator v1 API (PyTorchJobSpec: pytorchReplicaSpecs, nprocPerNode,
elasticPolicy), https://www.kubeflow.org/docs/components/trainer/legacy-v1/user-guides/pytorch/
"""
from __future__ import annotations

import copy
import re
import secrets

import yaml

from shardtune.config import RunConfig, dump_config
from shardtune.errors import UserError
from shardtune.launch.network import env_dict, preset
from shardtune.launch.paths import onto_claim
from shardtune.launch.resources import NodeResources, node_resources
from shardtune.launch.spec import LaunchSpec, check_k8s_name
from shardtune.launch.torchrun import TRAIN_MODULE

RECIPE_DIR = "/etc/shardtune"
RECIPE_FILE = "recipe.yaml"
DEFAULT_PVC = "shardtune-checkpoints"  # one claim for every job: each writes under its own name there


def unique_name(base: str) -> str:
    """`base` as a DNS label with a random suffix: two jobs of one recipe never share objects."""
    stem = re.sub(r"[^a-z0-9-]+", "-", base.lower()).strip("-")[:48].strip("-") or "shardtune"
    stem = stem if stem[0].isalpha() else f"job-{stem}"  # a PyTorchJob's name starts with a letter
    return f"{stem}-{secrets.token_hex(3)}"


def rdma_resource(spec: LaunchSpec) -> str | None:
    """The RDMA device resource a pod asks for (ib/roce, --rdma-resource NAME), or None."""
    if spec.interconnect not in ("ib", "roce") or spec.rdma_resource in (None, "none"):
        return None
    return spec.rdma_resource


def rdma_note(spec: LaunchSpec) -> str | None:
    """The loud line when an IB/RoCE job asks for no RDMA device."""
    if spec.interconnect in ("ib", "roce") and rdma_resource(spec) is None:
        return (f"warning: --interconnect {spec.interconnect} without an RDMA device: unless the pods get "
                "/dev/infiniband another way, NCCL falls back to TCP sockets without a word (NCCL_DEBUG=INFO shows "
                "'NET/Socket'); name your cluster's RDMA device plugin resource with --rdma-resource NAME (e.g. "
                "rdma/rdma_shared_device_a; it adds IPC_LOCK, outside the PodSecurity baseline)")
    return None


_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _label_key(flag: str, text: str, key: str) -> str:
    prefix, _, name = key.rpartition("/")
    if not _LABEL_NAME.fullmatch(name) or (prefix and (len(prefix) > 253 or not _LABEL_PREFIX.fullmatch(prefix))):
        raise UserError(f"{flag} {text!r}: {key!r} is not a Kubernetes label key (e.g. nvidia.com/gpu.product)")
    return key


def _label_value(flag: str, text: str, value: str) -> str:
    if value and not _LABEL_NAME.fullmatch(value):
        raise UserError(f"{flag} {text!r}: {value!r} is not a Kubernetes label value (63 characters: letters, "
                        "digits, - _ .)")
    return value


def node_selector(items: tuple[str, ...]) -> dict:
    """--node-selector KEY=VALUE, each → the pod's nodeSelector."""
    out = {}
    for text in items:
        key, eq, value = text.partition("=")
        if not eq:
            raise UserError(f"--node-selector {text!r}: give KEY=VALUE (e.g. "
                            "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3)")
        out[_label_key("--node-selector", text, key)] = _label_value("--node-selector", text, value)
    return out


def tolerations(items: tuple[str, ...]) -> list[dict]:
    """--toleration KEY[=VALUE][:EFFECT], kubectl taint's syntax, each → a toleration (no value:
    operator Exists; no effect: every effect)."""
    out = []
    for text in items:
        rest, colon, effect = text.rpartition(":") if ":" in text else (text, "", "")
        if colon and effect not in EFFECTS:
            raise UserError(f"--toleration {text!r}: the effect must be one of {', '.join(EFFECTS)}")
        key, eq, value = rest.partition("=")
        t = {"key": _label_key("--toleration", text, key), "operator": "Equal" if eq else "Exists"}
        if eq:
            t["value"] = _label_value("--toleration", text, value)
        if effect:
            t["effect"] = effect
        out.append(t)
    return out


def _limits(spec: LaunchSpec) -> dict:
    limits: dict = {"nvidia.com/gpu": spec.gpus_per_node}
    rdma = rdma_resource(spec)
    if rdma:  # the device plugin mounts /dev/infiniband into the container
        limits[rdma] = 1
    if spec.interconnect == "efa":
        # EKS hands EFA interfaces to pods through the aws-efa-k8s-device-plugin resource.
        if not spec.efa_devices:
            raise UserError("--interconnect efa on Kubernetes needs --efa-devices N (EFA interfaces per node: p5 "
                            "32, p4d 4)")
        limits["vpc.amazonaws.com/efa"] = spec.efa_devices
    return limits


class _Dumper(yaml.SafeDumper):
    """yaml.SafeDumper that writes multi-line strings (the embedded recipe) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None  # the emitter falls back to quoting when a block cannot hold it
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _requests(spec: LaunchSpec, res: NodeResources) -> dict:
    """CPU and memory per pod: the user's, else launch/resources.py's; the memory-backed /dev/shm
    counts against the pod's memory, so it is added."""
    return {"cpu": str(spec.cpus or res.cpus), "memory": spec.memory or f"{res.mem_gib + res.shm_gib}Gi"}


def _pod_template(spec: LaunchSpec, config_map: str, pvc: str, res: NodeResources) -> dict:
    env = [{"name": k, "value": v} for k, v in env_dict(preset(spec.interconnect, spec.ifname, spec.ib_hca)).items()]
    # SIGTERM on pod deletion/preemption: give the trainer time to checkpoint (default grace is 30 s).
    env.append({"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(int(spec.checkpoint_grace_s))})
    requests = _requests(spec, res)  # memory limit = request: the pod is never killed below what it asked
    container = {
        "name": "pytorch",  # the operator finds the training container by this name
        "image": spec.image,
        "command": ["torchrun"],
        "args": ["--nproc-per-node", str(spec.gpus_per_node), "-m", TRAIN_MODULE, f"{RECIPE_DIR}/{RECIPE_FILE}"],
        "env": env,
        "resources": {"requests": requests, "limits": {**_limits(spec), "memory": requests["memory"]}},
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "checkpoints", "mountPath": spec.checkpoint_mount},
            {"name": "recipe", "mountPath": RECIPE_DIR, "readOnly": True},
        ],
    }
    if rdma_resource(spec):  # verbs pin (mlock) their buffers: the container's memlock limit needs IPC_LOCK
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    pod: dict = {"terminationGracePeriodSeconds": int(spec.checkpoint_grace_s) + 30}
    if spec.node_selector:
        pod["nodeSelector"] = node_selector(spec.node_selector)
    if spec.tolerations:
        pod["tolerations"] = tolerations(spec.tolerations)
    return {
        "spec": {
            **pod,
            "containers": [container],
            "volumes": [
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{res.shm_gib}Gi"}},
                {"name": "checkpoints", "persistentVolumeClaim": {"claimName": pvc}},
                {"name": "recipe", "configMap": {"name": config_map}},
            ],
        }
    }


def build_manifests(spec: LaunchSpec, cfg: RunConfig, res: NodeResources | None = None) -> list[dict]:
    """[ConfigMap, PyTorchJob] as dicts (see the module docstring). No --job-name: a unique one."""
    name = check_k8s_name("--job-name", spec.job_name or unique_name(cfg.name), letter_first=True)
    res = res or node_resources(cfg, spec.nodes, spec.gpus_per_node)
    if not spec.image:
        raise UserError("--image is needed for Kubernetes: a container image with shardtune installed")
    pvc = check_k8s_name("--pvc", spec.pvc or DEFAULT_PVC)
    config_map = f"{name}-recipe"
    # Inputs and the run folder on the shared volume: the pods see only the image and their volumes,
    # and any pod of a restarted job finds the checkpoints (launch/paths.py).
    cfg = onto_claim(cfg, spec.checkpoint_mount)
    cfg = cfg.model_copy(update={"output_dir": f"{spec.checkpoint_mount.rstrip('/')}/{name}"})
    template = _pod_template(spec, config_map, pvc, res)
    job_spec: dict = {"nprocPerNode": str(spec.gpus_per_node), "pytorchReplicaSpecs": {}}
    if spec.elastic:
        lo, hi = spec.elastic
        if not 1 <= lo <= hi:
            raise UserError(f"--elastic {lo}:{hi}: need 1 <= MIN <= MAX nodes")
        job_spec["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": lo, "maxReplicas": hi,
                                     "maxRestarts": spec.max_restarts}
        # Elastic jobs are workers only: any of them may host the c10d rendezvous.
        job_spec["pytorchReplicaSpecs"]["Worker"] = {"replicas": spec.nodes, "restartPolicy": "OnFailure",
                                                     "template": copy.deepcopy(template)}
    else:
        job_spec["pytorchReplicaSpecs"]["Master"] = {"replicas": 1, "restartPolicy": "OnFailure",
                                                     "template": copy.deepcopy(template)}
        if spec.nodes > 1:
            job_spec["pytorchReplicaSpecs"]["Worker"] = {"replicas": spec.nodes - 1, "restartPolicy": "OnFailure",
                                                         "template": copy.deepcopy(template)}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": config_map},
         "data": {RECIPE_FILE: dump_config(cfg)}},
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name}, "spec": job_spec},
    ]


def render_k8s(spec: LaunchSpec, cfg: RunConfig, res: NodeResources | None = None) -> str:
    docs = build_manifests(spec, cfg, res)
    pod = next(iter(docs[1]["spec"]["pytorchReplicaSpecs"].values()))["template"]["spec"]
    shm = next(v["emptyDir"]["sizeLimit"] for v in pod["volumes"] if v["name"] == "dshm")
    memory = pod["containers"][0]["resources"]["requests"]["memory"]
    header = ("# Generated by `shardtune launch k8s`. Apply with: kubectl apply -f THIS_FILE\n"
              "# Needs the Kubeflow training operator and a ReadWriteMany PersistentVolumeClaim for checkpoints.\n"
              f"# /dev/shm: a memory-backed emptyDir of {shm} (2 GiB per process: NCCL's shared-memory transport "
              "and DataLoader batches;\n# the container runtime's 64 MiB default is too small). It counts against "
              f"the pod's memory: the request and limit ({memory}) include it.\n")
    return header + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)
