"""`shardtune train ... --ep N` refuses what expert parallelism cannot run in one line, exit 2, before
any process starts (rules/ep.py, Layout.build, Layout.check_model); what it runs
is tests/e2e/test_moe_cli.py's."""
from __future__ import annotations

import pytest
from _cli import REPO, refused_before_any_process

MOE = REPO / "recipes" / "tiny-moe-cpu.yaml"  # tiny-mixtral: 4 experts a layer, save_final false
DENSE = REPO / "recipes" / "tiny-cpu.yaml"
NO_CKPT = ["checkpoint.save_final=false", "checkpoint.export_hf=false"]

BAD = [
    (DENSE, ["--nproc", "2", "--ep", "2", *NO_CKPT], "needs a mixture-of-experts model"),
    (MOE, ["--nproc", "3", "--ep", "3"], "does not divide the 4 experts per layer"),
    (MOE, ["--nproc", "2", "--ep", "4"], "must divide dp_shard x cp = 2"),
    (MOE, ["--nproc", "4", "--ep", "2", "--strategy", "hsdp", "parallel.hsdp_shard_size=1"],
     "must divide dp_shard x cp = 1"),
    (MOE, ["--nproc", "2", "--ep", "2", "--strategy", "ddp"], "does not compose with strategy 'ddp'"),
    (MOE, ["--nproc", "2", "--ep", "2", "--strategy", "zero1"], "does not compose with strategy 'zero1'"),
    # tp on a MoE model without ep: the experts are not tp-split (docs/moe.md "ep with tp and cp")
    (MOE, ["--nproc", "2", "--tp", "2"], "needs expert parallelism"),
    (MOE, ["--nproc", "4", "--ep", "2", "--tp", "2", "parallel.sequence_parallel=false", "train.seq_len=63"],
     "make train.seq_len 63 a multiple of 2"),
    (MOE, ["--nproc", "6", "--ep", "3", "--cp", "2"], "and be a multiple of cp 2"),
    (MOE, ["--nproc", "2", "--ep", "2", "--lora-rank", "4", "lora.target_parameters=[experts.down_proj]"],
     "does not compose with LoRA on the experts"),
    (MOE, ["--nproc", "2", "--ep", "2", "--lora-rank", "4", "lora.quantize_base=nf4"], "does not compose with QLoRA"),
    (MOE, ["--nproc", "2", "--ep", "0"], "parallel.ep"),
    # ep x tp beyond the world: tp 2 of 2 ranks leaves one data rank, which ep 2 cannot borrow twice
    (MOE, ["--nproc", "2", "--ep", "2", "--tp", "2"], "must divide dp_shard x cp = 1"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe, args, needle", BAD, ids=[b[2] for b in BAD])
def test_train_refuses_before_any_process(monkeypatch, capsys, tmp_path, recipe, args, needle):
    err = refused_before_any_process(monkeypatch, capsys, ["train", recipe, "--output-dir", tmp_path / "run", *args])
    assert needle in err


@pytest.mark.timeout(120)
def test_top_k_beyond_the_experts_is_refused_by_train_and_plan(monkeypatch, capsys, tmp_path):
    """A model folder whose config.json asks each token for more experts than a layer has (top-8 of 4)."""
    import json

    from shardtune.catalog.models import MODELS

    folder = tmp_path / "top8of4"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**MODELS["tiny-mixtral"]["config"], "num_experts_per_tok": 8}))
    needle = "num_experts_per_tok 8 exceeds the 4 experts per layer"
    assert needle in refused_before_any_process(monkeypatch, capsys, [
        "train", MOE, "--output-dir", tmp_path / "run", "--nproc", "2", f"model.name={folder}"])
    assert needle in refused_before_any_process(monkeypatch, capsys, ["plan", folder, "--gpus", "2"])


@pytest.mark.timeout(120)
def test_a_router_the_trainer_does_not_reproduce_is_refused_by_train_and_launch_not_plan(monkeypatch, capsys, tmp_path):
    """DeepSeek-V3 routes by sigmoid scores, group-limited top-k and a balancing bias; the trainer's fp32
    router is softmax top-k (train/core/moe.py), so training it would route wrongly: refused; planned."""
    from shardtune import cli

    needle = "training 'deepseek_v3' mixtures of experts is not built"
    assert needle in refused_before_any_process(monkeypatch, capsys, [
        "train", MOE, "--output-dir", tmp_path / "run", "--nproc", "2", "model.name=deepseek-v3"])
    assert needle in refused_before_any_process(monkeypatch, capsys, [
        "launch", "slurm", MOE, "--nodes", "8", "--gpus-per-node", "8", "model.name=deepseek-v3"])
    assert cli.main(["plan", "deepseek-v3", "--gpus", "64", "--nodes", "8", "--json"]) == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needle", [
    (["slurm", MOE, "--nodes", "1", "--gpus-per-node", "3", "--ep", "3"], "does not divide the 4 experts per layer"),
    (["torchrun", MOE, "--nodes", "2", "--gpus-per-node", "2", "--ep", "8"], "must divide dp_shard x cp = 4"),
    (["k8s", DENSE, "--nodes", "2", "--gpus-per-node", "2", "--ep", "2", "--image", "x/y:1", *NO_CKPT],
     "needs a mixture-of-experts model"),
    (["slurm", MOE, "--nodes", "1", "--gpus-per-node", "2", "parallel.tp=2"], "needs expert parallelism"),
])
def test_launch_checks_ep_as_the_trainer_does(monkeypatch, capsys, args, needle):
    assert needle in refused_before_any_process(monkeypatch, capsys, ["launch", *args])


def test_launch_passes_ep_to_every_node(capsys, tmp_path):
    """--ep N reaches the nodes' trainers as parallel.ep=N (the script's command line; k8s: its recipe)."""
    from shardtune import cli

    assert cli.main(["launch", "slurm", str(MOE), "--nodes", "2", "--gpus-per-node", "2", "--ep", "4"]) == 0
    assert "tiny-moe-cpu.yaml parallel.ep=4" in capsys.readouterr().out
    assert cli.main(["launch", "k8s", str(MOE), "--nodes", "2", "--gpus-per-node", "2", "--ep", "2",
                     "--image", "x/y:1"]) == 0
    assert "\n      ep: 2\n" in capsys.readouterr().out
    # with tp and with cp (launch takes them as overrides): the layouts `shardtune train` runs
    for extra, nodes in (("parallel.tp=2", "2"), ("parallel.cp=2", "1")):
        argv = ["launch", "slurm", str(MOE), "--nodes", nodes, "--gpus-per-node", "2", "--ep", "2", extra]
        assert cli.main(argv) == 0
        assert f"tiny-moe-cpu.yaml {extra} parallel.ep=2" in capsys.readouterr().out
