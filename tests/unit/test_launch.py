"""Launch renderers: generated scripts run (with stubbed torchrun/srun/scontrol) and pass exactly the
user's values; hostile values cannot inject; manifests parse and carry the fields; presets and the
communication estimate match the docs and a hand derivation."""
from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shardtune.config import build_config, load_recipe
from shardtune.errors import UserError
from shardtune.launch.advice import comm_bound_warning, estimate
from shardtune.launch.k8s import build_manifests, render_k8s
from shardtune.launch.network import env_dict, preset
from shardtune.launch.slurm import render_slurm
from shardtune.launch.spec import LaunchSpec, parse_slurm_time_s, validate
from shardtune.launch.torchrun import render_torchrun

SHARDTUNE = [sys.executable, "-m", "shardtune.cli"]
HOSTILE = "a b'c\"d $(touch PWNED) `touch PWNED2` ;touch PWNED3\nnext line $HOME \\ *"

# A stand-in for torchrun/srun/scontrol/scancel: records argv (JSON) and chosen env, then acts.
STUB = r'''#!{py}
import json, os, signal, sys, time
name = os.path.basename(sys.argv[0])
log = os.environ["STUB_LOG"]
with open(log, "a") as f:
    env = {{k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "GLOO_", "FI_", "TORCH_ELASTIC"))}}
    f.write(json.dumps({{"tool": name, "argv": sys.argv[1:], "env": env, "pid": os.getpid()}}) + "\n")
if name == "scontrol" and sys.argv[1:3] == ["show", "hostnames"]:
    print("node-a\nnode-b")
elif name == "srun":  # drop srun's options, run the command (one task is enough here)
    args = [a for a in sys.argv[1:]]
    while args and args[0].startswith("--"):
        args.pop(0)
    os.execvp(args[0], args)
elif name == "scancel":  # signal the job step: the torchrun stub recorded its pid
    pid = int(open(os.environ["STUB_LOG"] + ".torchrun_pid").read())
    os.kill(pid, signal.SIGTERM)
elif name == "torchrun":
    open(log + ".torchrun_pid", "w").write(str(os.getpid()))
    if os.environ.get("STUB_WAIT_FOR_TERM"):
        def on_term(*_):
            with open(log, "a") as f:
                f.write(json.dumps({{"tool": "torchrun-got-SIGTERM"}}) + "\n")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        for _ in range(200):
            time.sleep(0.05)
        sys.exit(9)
    sys.exit(int(os.environ.get("STUB_RC", "0")))
'''


@pytest.fixture
def stubs(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("torchrun", "srun", "scontrol", "scancel"):
        p = bindir / tool
        p.write_text(STUB.format(py=sys.executable))
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.jsonl"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "STUB_LOG": str(log), "HOME": str(tmp_path)}
    return env, log


def _calls(log: Path) -> list[dict]:
    return [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def hostile_recipe(tmp_path):
    d = tmp_path / HOSTILE.replace("/", "_")
    d.mkdir()
    p = d / "recipe $(x).yaml"
    p.write_text("model:\n  name: tiny-llama\n")
    return str(p)


def _spec(recipe, **kw):
    base = dict(recipe=recipe, nodes=2, gpus_per_node=4, interconnect="eth", rdzv_host="10.0.0.1", rdzv_port=29511)
    base.update(kw)
    return validate(LaunchSpec(**base))


def test_bash_syntax_of_every_renderer(tmp_path, hostile_recipe):
    for text in (render_torchrun(_spec(hostile_recipe, overrides=(f"name={HOSTILE}",))),
                 render_slurm(_spec(hostile_recipe, overrides=(f"name={HOSTILE}",), time="1:00:00"))):
        f = tmp_path / "s.sh"
        f.write_text(text)
        r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr


@pytest.mark.timeout(60)
def test_torchrun_script_passes_hostile_values_verbatim(tmp_path, stubs, hostile_recipe):
    env, log = stubs
    override = f"name={HOSTILE}"
    spec = _spec(hostile_recipe, overrides=(override, "train.max_steps=3"), ifname="eth1", max_restarts=2, run_id="r1")
    script = tmp_path / "node.sh"
    script.write_text(render_torchrun(spec))
    r = subprocess.run(["bash", str(script)], env={**env, "NODE_RANK": "0", "LOCAL_ADDR": "10.0.0.1"}, cwd=tmp_path,
                       capture_output=True, text=True, timeout=30, start_new_session=True)
    assert r.returncode == 0, r.stderr
    (call,) = _calls(log)
    # Expected argv written out by hand from torchrun's documented options.
    assert call["argv"] == [
        "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29511",
        "--rdzv-id", "r1", "--max-restarts", "2", "--rdzv-conf", "is_host=true", "--local-addr", "10.0.0.1",
        "-m", "shardtune.train", hostile_recipe, override, "train.max_steps=3"]
    assert call["env"]["GLOO_SOCKET_IFNAME"] == "eth1" and call["env"]["NCCL_SOCKET_IFNAME"] == "=eth1"
    assert not list(tmp_path.glob("PWNED*")) and not list(Path(hostile_recipe).parent.glob("PWNED*"))


@pytest.mark.timeout(60)
def test_torchrun_script_on_a_non_host_node(tmp_path, stubs):
    env, log = stubs
    recipe = tmp_path / "r.yaml"
    recipe.write_text("{}\n")
    script = tmp_path / "node.sh"
    script.write_text(render_torchrun(_spec(str(recipe))))
    subprocess.run(["bash", str(script)], env={**env, "NODE_RANK": "1"}, check=True, timeout=30, capture_output=True)
    argv = _calls(log)[0]["argv"]
    assert argv[argv.index("--rdzv-conf") + 1] == "is_host=false" and "--local-addr" not in argv


def _run_sbatch(tmp_path, env, text, **extra_env):
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    slurm_env = {**env, "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]", **extra_env}
    return subprocess.Popen(["bash", str(script)], env=slurm_env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.timeout(60)
def test_sbatch_script_runs_torchrun_on_first_node_rendezvous(tmp_path, stubs, hostile_recipe):
    env, log = stubs
    override = f"name={HOSTILE}"
    p = _run_sbatch(tmp_path, env, render_slurm(_spec(hostile_recipe, overrides=(override,), time="2:00:00",
                                                              cpus_per_task=16)), STUB_RC="3")
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 3, out  # the training step's failure is the job's exit code
    calls = _calls(log)
    tools = [c["tool"] for c in calls]
    assert tools == ["scontrol", "srun", "torchrun"], tools  # no requeue without the signal
    # srun gets --cpus-per-task itself: Slurm >= 22.05 no longer passes sbatch's value to steps
    assert calls[1]["argv"][:4] == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=16"]
    assert calls[2]["argv"] == [
        "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node-a:29511",
        "--rdzv-id", "4242", "--max-restarts", "0", "-m", "shardtune.train", hostile_recipe, override]
    assert calls[2]["env"]["NCCL_SOCKET_NTHREADS"] == "4"
    assert not list(tmp_path.glob("PWNED*"))


@pytest.mark.timeout(60)
def test_sbatch_time_limit_signal_checkpoints_then_requeues(tmp_path, stubs):
    env, log = stubs
    recipe = tmp_path / "r.yaml"
    recipe.write_text("{}\n")
    p = _run_sbatch(tmp_path, env, render_slurm(_spec(str(recipe), time="1:00:00", checkpoint_grace_s=120)),
                    STUB_WAIT_FOR_TERM="1")
    try:
        deadline = time.time() + 20
        while not (log.with_name(log.name + ".torchrun_pid")).exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        os.kill(p.pid, signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@120` delivers to the batch shell
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    tools = [c["tool"] for c in _calls(log)]
    assert tools[-3:] == ["scancel", "torchrun-got-SIGTERM", "scontrol"], (tools, out)
    assert _calls(log)[-1]["argv"] == ["requeue", "4242"]
    assert _calls(log)[-3]["argv"] == ["--signal=TERM", "4242"]
    assert p.returncode == 0, out


def test_sbatch_header_values():
    text = render_slurm(_spec("r.yaml", time="2-00:00:00", partition="gpu", account="proj-1", checkpoint_grace_s=600,
                              job_name="ft.8b", cpus_per_task=32, log="logs/%x-%j.out"))
    header = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert header == ["#SBATCH --job-name=ft.8b", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                      "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=32", "#SBATCH --partition=gpu",
                      "#SBATCH --account=proj-1", "#SBATCH --time=2-00:00:00", "#SBATCH --output=logs/%x-%j.out",
                      "#SBATCH --signal=B:USR1@600", "#SBATCH --requeue"]
    # sbatch stops reading #SBATCH lines at the first command: they must all come first
    first_cmd = next(i for i, ln in enumerate(text.splitlines()[1:]) if ln and not ln.startswith("#"))
    assert all(i < first_cmd for i, ln in enumerate(text.splitlines()[1:]) if ln.startswith("#SBATCH"))


@pytest.mark.parametrize("field,value", [("job_name", "my job"), ("job_name", "x\n#SBATCH --account=other"),
                                         ("job_name", "$(rm -rf /)"), ("partition", "gpu;ls"), ("account", "a'b"),
                                         ("log", "out put.log"), ("time", "1h")])
def test_sbatch_rejects_values_it_cannot_carry(field, value):
    with pytest.raises(UserError) as e:
        render_slurm(_spec("r.yaml", **{field: value}))
    assert "\n" not in str(e.value)


def test_slurm_time_formats():
    # sbatch(1): "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
    # "days-hours:minutes" and "days-hours:minutes:seconds"
    assert [parse_slurm_time_s(t) for t in ("90", "5:30", "4:00:00", "2-12", "1-2:30", "1-00:00:01")] == \
        [5400, 330, 14400, 2 * 86400 + 12 * 3600, 86400 + 2 * 3600 + 1800, 86401]
    with pytest.raises(UserError):
        render_slurm(_spec("r.yaml", time="5", checkpoint_grace_s=300))  # 5 minutes = the whole grace


def test_pytorchjob_manifest_fields_and_hostile_values(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  name: tiny-llama\ntrain:\n  max_steps: 5\n")
    overrides = (f"name={HOSTILE}",)
    cfg = load_recipe(recipe, overrides)
    spec = _spec(str(recipe), overrides=overrides, nodes=3, gpus_per_node=8, interconnect="roce", job_name="ft-8b",
                 image="ghcr.io/me/shardtune:1", pvc="shared-ckpt")
    cm, job = list(yaml.safe_load_all(render_k8s(spec, cfg)))
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", "ft-8b")
    reps = job["spec"]["pytorchReplicaSpecs"]
    assert reps["Master"]["replicas"] == 1 and reps["Worker"]["replicas"] == 2
    assert job["spec"]["nprocPerNode"] == "8" and "elasticPolicy" not in job["spec"]
    pod = reps["Worker"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["name"] == "pytorch" and c["image"] == "ghcr.io/me/shardtune:1"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}  # 2 GiB x 8 processes
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == "shared-ckpt"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm" and mounts["checkpoints"] == "/checkpoints"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NCCL_IB_GID_INDEX"] == "3"
    # The embedded recipe is the resolved one (what the trainer would see from the same recipe and
    # overrides): the hostile name survives byte for byte
    embedded = build_config(yaml.safe_load(cm["data"]["recipe.yaml"]))
    assert "$(touch PWNED)" in cfg.name and embedded.name == cfg.name and embedded.train.max_steps == 5
    assert embedded.output_dir == "/checkpoints/ft-8b"  # the job's own folder on the claim
    assert c["args"][-1] == "/etc/shardtune/recipe.yaml"


def test_pytorchjob_elastic_policy(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("{}\n")
    spec = _spec(str(recipe), nodes=4, image="img", elastic=(2, 4), max_restarts=3)
    _, job = build_manifests(spec, load_recipe(recipe))
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 4, "maxRestarts": 3}
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4


def test_pytorchjob_efa_devices(tmp_path):
    with pytest.raises(UserError, match="--efa-devices"):
        build_manifests(_spec("r.yaml", interconnect="efa", image="img"), load_recipe(None))
    _, job = build_manifests(_spec("r.yaml", interconnect="efa", image="img", efa_devices=32), load_recipe(None))
    (c,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 4, "vpc.amazonaws.com/efa": 32, "memory": "40Gi"}


@pytest.mark.parametrize("name", ["My_Job", "a" * 64, "job\nx", "-job"])
def test_pytorchjob_rejects_bad_names(tmp_path, name):
    with pytest.raises(UserError):
        build_manifests(_spec("r.yaml", job_name=name, image="img"), load_recipe(None))


def test_network_presets_use_documented_names():
    # Names and values from NCCL's env page, PyTorch's distributed docs and AWS's EFA guide.
    assert env_dict(preset("eth", "eth0")) == {
        "NCCL_SOCKET_IFNAME": "=eth0", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}
    assert env_dict(preset("roce", None, "mlx5_0,mlx5_1")) == {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_IB_GID_INDEX": "3"}
    assert env_dict(preset("efa")) == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_NET": "AWS Libfabric"}
    assert env_dict(preset("ib", "ib0,ib1")) == {"NCCL_SOCKET_IFNAME": "=ib0,=ib1", "GLOO_SOCKET_IFNAME": "ib0,ib1"}
    assert env_dict(preset("nvlink")) == {}
    for ic in ("nvlink", "ib", "roce", "efa", "eth"):
        for s in preset(ic):
            # NCCL's threads x sockets limit is 64 (env page, NCCL_NSOCKS_PERTHREAD)
            assert s.doc.startswith("https://") and s.why
    # 4 threads x 4 sockets stays within NCCL's documented product limit of 64
    eth = env_dict(preset("eth"))
    assert int(eth["NCCL_SOCKET_NTHREADS"]) * int(eth["NCCL_NSOCKS_PERTHREAD"]) <= 64


def test_nvlink_is_one_node_only():
    with pytest.raises(UserError):
        _spec("r.yaml", interconnect="nvlink")


def test_zero3_on_10gbe_is_comm_bound_and_hsdp_named():
    cfg = load_recipe(None, ["model.name=llama-3-8b", "train.seq_len=2048", "train.micro_batch=2"])
    est = estimate(cfg, nodes=2, gpus_per_node=8, interconnect="eth")
    # Hand derivation: Llama-3-8B has 8,030,261,248 parameters (HF model card / config).
    # zero3 per micro-batch: all-gather bf16 twice + reduce-scatter fp32 = 8 B/param over a flat
    # ring of 16 ranks: each node sends 15/16 of it through its one 10 GbE NIC at 90 % of
    # 1.25 GB/s. Latency comes on top: 3 collectives x 33 calls (32 layers + root) x 15 ring steps
    # x 50 us = 74 ms, well under 1 % of the bandwidth term at these sizes.
    psi = 8_030_261_248
    bandwidth_s = 8 * psi * 15 / 16 / (0.9 * 10e9 / 8)
    assert bandwidth_s * 0.9995 <= est.comm_s <= bandwidth_s * 1.01
    # Compute: PaLM 6N FLOPs/token (N without the 128256x4096 input embedding) + attention, at
    # 40 % of H100's 989.4 TFLOP/s, for 2 x 2048 tokens: about half a second.
    n_mm = psi - 128256 * 4096
    flops = (6 * n_mm + 12 * 32 * 32 * 128 * 2048) * 2 * 2048
    assert est.compute_s == pytest.approx(flops / (0.4 * 989.4e12), rel=1e-3)
    msg = comm_bound_warning(cfg, 2, 8, "eth")
    assert msg and "communication-bound" in msg and "parallel.strategy=hsdp" in msg and "hsdp_shard_size=8" in msg
    # On 8 x NDR InfiniBand the same step hides its traffic behind compute: no warning.
    assert comm_bound_warning(cfg, 2, 8, "ib") is None
    assert comm_bound_warning(cfg, 1, 8, "eth") is None
    one_gpu = comm_bound_warning(cfg, 4, 1, "eth")  # hsdp inside a 1-GPU node would be ddp: not offered
    assert one_gpu and "hsdp" not in one_gpu
    cpu = load_recipe(None, ["model.name=llama-3-8b", "train.backend=gloo"])
    assert comm_bound_warning(cpu, 2, 8, "eth") is None  # GPU step-time model: silent for CPU runs


@pytest.mark.timeout(120)
def test_cli_refuses_a_layout_the_trainer_would_refuse(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("parallel:\n  strategy: hsdp\n  hsdp_shard_size: 3\n")
    # hand: 2 nodes x 8 GPUs = 16 ranks, 16 % 3 != 0; the trainer's own check (layout.Layout)
    r = _cli("launch", "torchrun", str(recipe), "--nodes", "2", "--gpus-per-node", "8", "--rdzv-host", "h0")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "hsdp shard size 3 does not divide the world size 16" in r.stderr
    # an elastic k8s job of 2..3 nodes x 2 GPUs: shard size 3 fails at 2 nodes (4 ranks), fits 3 (6)
    r = _cli("launch", "k8s", str(recipe), "--nodes", "3", "--gpus-per-node", "2", "--image", "img",
             "--elastic", "2:3")
    assert r.returncode == 2 and "does not divide the world size 4" in r.stderr, r.stderr
    r = _cli("launch", "k8s", str(recipe), "--nodes", "3", "--gpus-per-node", "2", "--image", "img")
    assert r.returncode == 0, r.stderr


def _cli(*args, cwd=None):
    return subprocess.run([*SHARDTUNE, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.timeout(120)
def test_cli_writes_file_and_reports_bad_values_in_one_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  name: llama-3-8b\n")
    out = tmp_path / "job.sbatch"
    r = _cli("launch", "slurm", str(recipe), "--nodes", "2", "--gpus-per-node", "8", "--interconnect", "eth",
             "--time", "4:00:00", "-o", str(out), "train.seq_len=2048")
    assert r.returncode == 0, r.stderr
    assert out.read_text().startswith("#!/usr/bin/env bash\n#SBATCH --job-name=shardtune")
    assert "communication-bound" in r.stderr and "hsdp" in r.stderr
    # a relative recipe path becomes absolute: the job may start in another folder
    r = _cli("launch", "torchrun", "r.yaml", cwd=tmp_path)
    assert r.returncode == 0 and f"-m shardtune.train {recipe}" in r.stdout, r.stdout
    r = _cli("launch", "slurm", str(recipe), "--job-name", "my job")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    r = _cli("launch", "torchrun", str(recipe), "--nodes", "2")
    assert r.returncode == 2 and "--rdzv-host" in r.stderr
    r = _cli("launch", "slurm", str(recipe), "--link", "eth-1000g")
    assert r.returncode == 2 and "eth-1000g" in r.stderr
    r = _cli("launch", "k8s", str(recipe), "parallel.strategy=zero9", "--image", "x")
    assert r.returncode == 2 and "zero9" in r.stderr


@pytest.mark.parametrize("field,value", [
    ("job_name", "job\n"), ("partition", "gpu\n"), ("account", "acct\n"), ("ifname", "eth0\n"),
    ("image", "ghcr.io/org/img:1\n"), ("image", "img; rm -rf /"), ("ib_hca", "mlx5_0\n"), ("ib_hca", "mlx5_0 $(x)"),
    ("rdzv_host", "10.0.0.1\n"),
])
def test_values_reaching_generated_files_are_matched_in_full(tmp_path, field, value):
    # issue 15: re.match("^…$") let a trailing newline through into #SBATCH lines
    with pytest.raises(UserError) as e:
        render_slurm(_spec(str(tmp_path / "r.yaml"), time="1:00:00", **{field: value}))
    assert "\n" not in str(e.value)


def test_well_formed_launch_values_pass_and_each_script_has_its_own_rdzv_id(tmp_path):
    spec = _spec(str(tmp_path / "r.yaml"), image="ghcr.io/org/shardtune:1.0", ib_hca="=mlx5_0:1,mlx5_1",
                 partition="gpu", account="acct", ifname="eth0,ib0")
    ids = {line.split("--rdzv-id ")[1].split()[0] for line in (render_torchrun(spec), render_torchrun(spec))
           for line in line.splitlines() if "--rdzv-id" in line}
    assert len(ids) == 2, ids  # two jobs generated on one host never share a rendezvous by default


@pytest.mark.timeout(120)
def test_a_placeholder_image_is_one_line_and_no_file(tmp_path):
    """`--image REGISTRY/IMAGE` (the README's old placeholder; an image reference is lower case):
    one line, exit 2, no manifest written."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  name: llama-3-8b\n")
    out = tmp_path / "job.yaml"
    r = _cli("launch", "k8s", str(recipe), "--nodes", "2", "--gpus-per-node", "8", "--image", "REGISTRY/IMAGE",
             "-o", str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "'REGISTRY/IMAGE' is not a container image reference" in r.stderr
    assert not out.exists()


def test_the_launchers_estimate_plans_the_recipes_cp_and_lora_not_a_subset():
    """advice.estimate once passed a hand-picked subset of the recipe to the planner (no cp, LoRA,
    optimizer): its step time is the planner's for the recipe's own inputs, here cp 2 + LoRA."""
    from shardtune.plan import plan

    cfg = load_recipe(None, ["model.name=llama-3-8b", "train.seq_len=16384", "parallel.cp=2", "lora.rank=16",
                             "train.micro_batch=4"])
    est = estimate(cfg, nodes=2, gpus_per_node=8, interconnect="eth")
    p = plan("llama-3-8b", gpus=16, nodes=2, gpus_per_node=8, seq_len=16384, micro_batch=4, cp=2, lora_rank=16,
             strategies=["zero3"], interconnect="eth-10g").strategy("zero3").timing
    assert est.step_s == pytest.approx(p["step_time_s"], rel=1e-9)
    no_cp = plan("llama-3-8b", gpus=16, nodes=2, gpus_per_node=8, seq_len=16384, micro_batch=4, lora_rank=16,
                 strategies=["zero3"], interconnect="eth-10g").strategy("zero3").timing
    assert est.step_s != pytest.approx(no_cp["step_time_s"], rel=1e-3)  # cp changes the step: it was planned


# each layout option (config/flags.py LAUNCH_FLAGS) and the override it stands for, on a recipe that runs it
LAYOUT_CASES = {
    "strategy": ("tiny-cpu.yaml", "hsdp", ()),
    "tp": ("tiny-cpu.yaml", "2", ()),
    "cp": ("tiny-cpu.yaml", "2", ()),
    "ep": ("tiny-moe-cpu.yaml", "2", ()),
    "pp": ("tiny-cpu.yaml", "2", ("train.grad_accum=2",)),
}


@pytest.mark.parametrize("launcher", ["torchrun", "slurm", "k8s"])
def test_each_layout_option_is_its_override_on_every_node(tmp_path, launcher, capsys):
    # `--tp 2` writes the script `parallel.tp=2` writes (the override the trainer's flag stands for,
    # config/flags.py), byte for byte: checked by launch as the trainer checks it, passed to every node
    from shardtune.cli import main
    from shardtune.config.flags import LAUNCH_FLAGS

    root = Path(__file__).resolve().parents[2]
    assert set(LAYOUT_CASES) == {f.name for f in LAUNCH_FLAGS}
    extra = {"torchrun": ["--rdzv-host", "h0", "--run-id", "r1"], "slurm": [], "k8s": ["--image", "img:1"]}[launcher]
    for flag in LAUNCH_FLAGS:
        recipe, value, overrides = LAYOUT_CASES[flag.name]
        base = ["launch", launcher, str(root / "recipes" / recipe), *overrides, "--nodes", "2", "--gpus-per-node", "2",
                "--job-name", "j1", *extra]
        by_flag, by_key, plain = (tmp_path / f"{flag.name}-{k}" for k in ("flag", "key", "plain"))
        assert main([*base, flag.option, value, "-o", str(by_flag)]) == 0, capsys.readouterr().err
        override = f"{flag.key}={json.dumps(flag.type(value))}"  # as `shardtune train --strategy hsdp` passes it
        assert main([*base, override, "-o", str(by_key)]) == 0, capsys.readouterr().err
        assert main([*base, "-o", str(plain)]) == 0, capsys.readouterr().err
        assert by_flag.read_bytes() == by_key.read_bytes(), flag.name
        assert by_flag.read_bytes() != plain.read_bytes(), flag.name  # the option changed the job
        if launcher != "k8s":  # the nodes' trainer command line (k8s: the ConfigMap's resolved recipe)
            assert shlex.quote(override) in by_flag.read_text(), flag.name
