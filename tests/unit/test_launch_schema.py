"""The rendered PyTorchJob against the Kubeflow training operator's own CRD schema (v1.9.0, made
strict as `kubeconform -strict`: tests/unit/schemas/README.md) and its admission webhook's rules;
the ConfigMap against Kubernetes' ConfigMap fields; node.sh's arrays guarded for bash 4.2's `set -u`."""
from __future__ import annotations

import gzip
import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from shardtune.config import load_recipe
from shardtune.launch.k8s import render_k8s
from shardtune.launch.slurm import render_slurm
from shardtune.launch.spec import LaunchSpec, validate
from shardtune.launch.torchrun import render_torchrun

SCHEMA = Path(__file__).parent / "schemas" / "pytorchjob-v1.9.0.schema.json.gz"


def _strict(node):
    """Objects with `properties` take no other key (the API server would prune it silently),
    unless the schema says more may come."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


VALIDATOR = jsonschema.Draft7Validator(_strict(json.loads(gzip.decompress(SCHEMA.read_bytes()))))
# Kubernetes' ConfigMap (core/v1: apiVersion, kind, metadata, data, binaryData, immutable);
# metadata.name is an RFC 1123 subdomain, data keys [-._a-zA-Z0-9]+ (the API reference).
_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
CONFIGMAP = jsonschema.Draft7Validator({
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata"],
    "properties": {
        "apiVersion": {"const": "v1"}, "kind": {"const": "ConfigMap"}, "immutable": {"type": "boolean"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string", "maxLength": 253, "pattern": _SUBDOMAIN}}},
        "data": {"type": "object", "propertyNames": {"pattern": r"^[-._a-zA-Z0-9]+$"},
                 "additionalProperties": {"type": "string"}},
        "binaryData": {"type": "object", "additionalProperties": {"type": "string"}},
    }})


def webhook_errors(job: dict) -> list[str]:
    """The training operator's admission webhook for PyTorchJob (v1.9.0
    pkg/webhooks/pytorch/pytorchjob_webhook.go), rule by rule."""
    errs = []
    name = job["metadata"]["name"]
    if len(name) > 63 or not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):  # NameIsDNS1035Label
        errs.append(f"metadata.name {name!r}")
    spec = job["spec"]
    reps = spec.get("pytorchReplicaSpecs") or {}
    if not reps:
        errs.append("pytorchReplicaSpecs required")
    if "elasticPolicy" in spec and "Worker" not in reps:
        errs.append("elasticPolicy without Worker")
    for role, rs in reps.items():
        if role not in ("Master", "Worker"):
            errs.append(f"replica type {role}")
        containers = rs["template"]["spec"].get("containers") or []
        if not containers or any(not c.get("image") for c in containers):
            errs.append(f"{role}: containers and images required")
        if not any(c["name"] == "pytorch" for c in containers):
            errs.append(f"{role}: no container named pytorch")
        if role == "Master" and rs.get("replicas") != 1:
            errs.append("Master replicas must be 1")
        if role == "Worker" and rs.get("replicas") is not None and rs["replicas"] < 1:
            errs.append("Worker replicas >= 1")
    return errs


def _docs(tmp_path, **kw):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: ft-8b\nmodel:\n  name: llama-3-8b\ntrain:\n  gpu: h100-80gb\n")
    base = dict(recipe=str(recipe), nodes=2, gpus_per_node=8, image="ghcr.io/acme/shardtune:0.1")
    base.update(kw)
    return list(yaml.safe_load_all(render_k8s(validate(LaunchSpec(**base)), load_recipe(recipe))))


@pytest.mark.parametrize("kw", [
    {"rdma_resource": "rdma/rdma_shared_device_a"},  # --interconnect ib with the RDMA resource + IPC_LOCK
    {},  # the default: --interconnect ib, no RDMA resource unless asked
    {"interconnect": "roce", "ib_hca": "mlx5_0,mlx5_1", "ifname": "eth0", "job_name": "ft-8b"},
    {"interconnect": "efa", "efa_devices": 32, "cpus": 96, "memory": "1500Gi", "pvc": "fsx-claim"},
    {"interconnect": "eth", "nodes": 4, "elastic": (2, 4), "max_restarts": 3},
    {"rdma_resource": "none", "nodes": 1},
    {"tolerations": ("nvidia.com/gpu:NoSchedule", "dedicated=ml:NoExecute"),
     "node_selector": ("nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",)},
    {"rdma_resource": "nvidia.com/hostdev", "checkpoint_mount": "/mnt/ckpt"},
])
def test_manifests_pass_the_crd_schema_and_the_operator_webhook(tmp_path, kw):
    cm, job = _docs(tmp_path, **kw)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(job)]
    assert not errors, errors
    assert not webhook_errors(job), webhook_errors(job)
    assert not [e.message for e in CONFIGMAP.iter_errors(cm)]


def test_the_strict_schema_catches_what_the_api_server_would_prune_or_refuse(tmp_path):
    """The validator is not vacuous: a misspelt field, a bad quantity, a wrong type all fail."""
    _, job = _docs(tmp_path, rdma_resource="rdma/rdma_shared_device_a")
    c = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    c["resources"]["request"] = c["resources"].pop("requests")  # typo: pruned silently by the server
    c["securityContext"]["capabilities"]["add"] = "IPC_LOCK"  # a string, not a list
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] = "16GB"
    paths = {"/".join(map(str, e.absolute_path)) for e in VALIDATOR.iter_errors(job)}
    base = "spec/pytorchReplicaSpecs/Master/template/spec"
    assert f"{base}/containers/0/resources" in paths  # additionalProperties: 'request'
    assert f"{base}/containers/0/securityContext/capabilities/add" in paths
    assert any(p.startswith(f"{base}/volumes/0/emptyDir/sizeLimit") for p in paths), paths
    job["metadata"]["name"] = "8b-job"
    assert webhook_errors(job) == ["metadata.name '8b-job'"]


def test_a_recipe_name_starting_with_a_digit_still_gives_a_valid_job_name(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: 8b_FT.run\n")
    _, job = yaml.safe_load_all(render_k8s(validate(LaunchSpec(recipe=str(recipe), nodes=1, image="img")),
                                           load_recipe(recipe)))
    assert re.fullmatch(r"job-8b-ft-run-[0-9a-f]{6}", job["metadata"]["name"]), job["metadata"]["name"]
    assert not webhook_errors(job)


STUB = "#!/bin/sh\nprintf '%s\\n' \"$@\" > \"$STUB_ARGS\"\n"


@pytest.mark.timeout(60)
def test_node_sh_without_node_rank_or_local_addr_passes_nothing_extra(tmp_path):
    """The empty-array case that bash < 4.4 refused under `set -u` (no bash 4.2 is installable here:
    Debian 13 ships 5.2 only, and BASH_COMPAT=42 does not bring the old nounset rule back; the
    guard itself is checked by the next test)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("{}\n")
    f = tmp_path / "node.sh"
    f.write_text(render_torchrun(validate(LaunchSpec(recipe=str(recipe), nodes=2, gpus_per_node=1, interconnect="eth",
                                                     rdzv_host="10.0.0.1", run_id="r1"))))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "torchrun").write_text(STUB)
    (tmp_path / "bin" / "torchrun").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "STUB_ARGS": str(tmp_path / "args")}
    r = subprocess.run(["bash", str(f)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "args").read_text().splitlines() == [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29500",
        "--rdzv-id", "r1", "--max-restarts", "0", "-m", "shardtune.train", str(recipe)]


def test_generated_scripts_expand_arrays_only_guarded(tmp_path):
    """Every "${NAME[@]}" in a generated script is the guarded ${NAME[@]+"${NAME[@]}"} form."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("{}\n")
    spec = validate(LaunchSpec(recipe=str(recipe), nodes=2, gpus_per_node=4, rdzv_host="h0", time="1:00:00"))
    for text in (render_torchrun(spec), render_slurm(spec)):
        body = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
        for m in re.finditer(r'"\$\{(\w+)\[@\]\}"', body):
            guard = "${" + m.group(1) + "[@]+"
            assert body[max(0, m.start() - len(guard)):m.start()] == guard, body[m.start() - 30:m.end()]
        f = tmp_path / "s.sh"
        f.write_text(text)
        assert subprocess.run(["bash", "-n", str(f)], capture_output=True, timeout=30).returncode == 0


def test_schema_file_is_the_documented_one():
    """The vendored schema is what its README says: the PyTorchJob CRD, descriptions removed."""
    schema = json.loads(gzip.decompress(SCHEMA.read_bytes()))

    def keys(node):
        if isinstance(node, dict):
            yield from node
            for v in node.values():
                yield from keys(v)
        elif isinstance(node, list):
            for v in node:
                yield from keys(v)

    assert "description" not in set(keys(schema))
    spec = schema["properties"]["spec"]
    assert set(spec["properties"]) == {"elasticPolicy", "nprocPerNode", "pytorchReplicaSpecs", "runPolicy"}
    assert spec["required"] == ["pytorchReplicaSpecs"]
    assert SCHEMA.stat().st_size < 16_000
