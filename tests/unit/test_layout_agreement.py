"""plan, launch and train answer alike for every layout (issue 38): each row of the table is
planned (`shardtune.plan.plan`), launched (`shardtune launch slurm`) and checked as the trainer's
preflight checks it (`validate_for_launch`), and all three accept or all three refuse, as the row
says. The expected answers come from the rank geometry (torchrun numbers ranks node by node; a tp
group is tp consecutive ranks), the model's shapes and the divisibility of the world, by hand."""
from __future__ import annotations

import json

import pytest

from shardtune.cli import main
from shardtune.config import load_recipe
from shardtune.errors import UserError
from shardtune.plan import plan
from shardtune.train.launcher.preflight import validate_for_launch

# a Llama with 8 query and 8 KV heads, so tp 1, 2, 4, 8 split the model and cp follows the heads
_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 264, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
           "torch_dtype": "float32"}

OK = None
# nodes, GPUs per node, strategy, tp, cp, hsdp shard size, tp_across_nodes, and None (runs) or words every
# refusal holds
CASES = [
    (1, 8, "zero3", 1, 1, None, False, OK),
    (2, 6, "zero3", 4, 1, None, False, "straddle two nodes"),  # ranks 4-7 on nodes 0 and 1 (the case)
    (2, 6, "zero3", 4, 1, None, True, "straddle two nodes"),  # tp_across_nodes allows whole nodes only
    (2, 6, "zero3", 2, 1, None, False, OK),  # 2 divides 6: every group in one node
    (2, 6, "zero3", 3, 1, None, False, "attention heads"),  # 3 divides 6 but not the 8 heads
    (2, 4, "zero3", 8, 1, None, False, "exceeds the 4 GPUs of a node"),  # a group of two nodes, not allowed
    (2, 4, "zero3", 8, 1, None, True, OK),  # ... allowed: two whole nodes
    (4, 6, "zero3", 8, 1, None, True, "not a multiple of the 6 GPUs"),  # 8 ranks = a node and a third
    (1, 6, "zero3", 4, 1, None, False, "does not divide"),  # tp 4 and a world of 6
    (1, 8, "zero3", 1, 2, None, False, OK),
    (1, 8, "zero3", 1, 3, None, False, "does not divide the world size 8"),  # cp 3
    (1, 8, "zero3", 2, 2, None, False, OK),
    (2, 8, "zero3", 4, 4, None, False, "2 query heads per tp rank"),  # 8 heads / tp 4, not split 4 ways
    (2, 8, "zero3", 2, 4, None, False, OK),
    (1, 8, "ddp", 1, 2, None, False, "not 'ddp'"),  # cp needs FSDP's dp x cp mesh
    (1, 8, "ddp", 2, 1, None, False, "'ddp'"),  # tp needs DTensor params
    (2, 4, "hsdp", 1, 1, None, False, OK),  # shard group: one node's 4
    (2, 4, "hsdp", 1, 1, 3, False, "hsdp shard size 3 does not divide the world size 8"),
    (2, 4, "hsdp", 2, 1, 4, False, OK),  # dp = 8 / 2 = 4
    (2, 4, "hsdp", 2, 1, 8, False, "does not divide the data-parallel degree 4"),  # 8 > dp 4
    (2, 4, "hsdp", 1, 2, 2, False, OK),  # dp = 4, shard 2
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps(_CONFIG))
    return d


def _settings(tmp_path, model_dir, strategy, tp, cp, shard, across) -> list[str]:
    sets = [f"model.name={model_dir}", "model.init=random", f"parallel.strategy={strategy}", f"parallel.tp={tp}",
            f"parallel.cp={cp}", f"parallel.tp_across_nodes={str(across).lower()}", "train.seq_len=384",
            "train.micro_batch=1", "train.backend=gloo", "data.tokenizer=byte", "parallel.precision=fp32",
            f"output_dir={tmp_path}/run"]
    return sets + ([f"parallel.hsdp_shard_size={shard}"] if shard else [])


def _plans(model_dir, nodes, per_node, strategy, tp, cp, shard, across) -> str | None:
    try:
        row = plan(model=str(model_dir), gpus=nodes * per_node, gpus_per_node=per_node, strategies=[strategy],
                   tp=tp, cp=cp, hsdp_shard_size=shard, tp_across_nodes=across, seq_len=384,
                   precision="fp32").to_dict()["strategies"][0]
    except UserError as e:
        return str(e)
    return row.get("error")


def _launches(capsys, tmp_path, sets, nodes, per_node) -> str | None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: agree\n")
    rc = main(["launch", "slurm", str(recipe), "--nodes", str(nodes), "--gpus-per-node", str(per_node), *sets])
    out, err = capsys.readouterr()
    assert rc in (0, 2), err
    if rc == 0:  # written; its warnings (environment, submit-host paths) are not a refusal
        return None
    assert err.count("\n") == 1 and not out, err
    return err


def _trains(sets, nodes, per_node) -> str | None:
    try:
        validate_for_launch(load_recipe(None, sets), nodes * per_node, per_node)
    except UserError as e:
        return str(e)
    return None


@pytest.mark.parametrize("nodes, per_node, strategy, tp, cp, shard, across, refused", CASES)
def test_plan_launch_and_train_agree(tmp_path, capsys, model_dir, nodes, per_node, strategy, tp, cp, shard, across,
                                     refused):
    sets = _settings(tmp_path, model_dir, strategy, tp, cp, shard, across)
    answers = {"plan": _plans(model_dir, nodes, per_node, strategy, tp, cp, shard, across),
               "launch": _launches(capsys, tmp_path, sets, nodes, per_node),
               "train": _trains(sets, nodes, per_node)}
    if refused is None:
        assert answers == dict.fromkeys(answers), answers
    else:
        assert all(a and refused in a for a in answers.values()), answers


# pipeline stages (issue 40): nodes, GPUs per node, pp, tp, and None (runs) or words every refusal holds;
# pp is outermost, so stage s is ranks [s·w/pp, (s+1)·w/pp): whole nodes or a node's share, never parts of two
PP_CASES = [
    (2, 4, 2, 1, OK),  # a stage a node
    (1, 4, 2, 1, OK),  # two stages in a node, dp 2 in each (the model has 2 layers)
    (1, 4, 2, 2, OK),  # two stages in a node, tp 2 inside each
    (3, 2, 2, 1, "part of a node"),  # 3 ranks a stage: node 0, half of node 1
    (1, 8, 3, 1, "does not divide world"),
    (2, 4, 2, 8, "exceeds the 4 GPUs of a node"),  # tp still inside a node under pp
]


@pytest.mark.parametrize("nodes, per_node, pp, tp, refused", PP_CASES)
def test_pipeline_plan_launch_and_train_agree(tmp_path, capsys, model_dir, nodes, per_node, pp, tp, refused):
    sets = _settings(tmp_path, model_dir, "zero3", tp, 1, None, False) + [f"parallel.pp={pp}",
                                                                            f"train.grad_accum={pp}"]
    try:
        plan(model=str(model_dir), gpus=nodes * per_node, gpus_per_node=per_node, strategies=["zero3"], tp=tp,
             pp=pp, grad_accum=pp, seq_len=384, precision="fp32")
        planned = None
    except UserError as e:
        planned = str(e)
    _agree(planned, capsys, tmp_path, sets, nodes, per_node, refused)


def _agree(planned: str | None, capsys, tmp_path, sets, nodes, per_node, refused: str | None) -> None:
    """The plan's answer, launch's and the trainer's preflight's: all None, or all refusals holding `refused`."""
    answers = {"plan": planned, "launch": _launches(capsys, tmp_path, sets, nodes, per_node),
               "train": _trains(sets, nodes, per_node)}
    if refused is None:
        assert answers == dict.fromkeys(answers), answers
    else:
        assert all(a and refused in a for a in answers.values()), answers


# expert parallelism with tp and cp (docs/moe.md "ep with tp and cp"), on a Mixtral of 4 experts a layer:
# nodes, GPUs per node, strategy, tp, cp, ep, and None (runs) or words every refusal holds; ep borrows the
# data ranks, dp_shard x cp of them (tp ranks hold replicas of their experts)
_MOE = _CONFIG | {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
                  "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}
EP_CASES = [
    (1, 4, "zero3", 2, 1, 2, OK),  # ep 2 over the 2 data ranks of each tp index
    (1, 4, "zero3", 1, 2, 2, OK),  # ep 2 = the cp pair
    (1, 8, "zero3", 2, 2, 2, OK),  # ep x cp x tp
    (2, 4, "hsdp", 2, 1, 2, OK),  # hsdp's shard group: one node's 2 data ranks
    (1, 4, "zero3", 2, 1, 1, "needs expert parallelism"),  # the experts are not tp-split
    (1, 4, "zero3", 2, 1, 4, "ep 4"),  # tp ranks are not data ranks (plan words it its own way: "2 data-parallel")
    (1, 4, "ddp", 1, 1, 2, "does not compose with strategy 'ddp'"),
]


@pytest.mark.parametrize("nodes, per_node, strategy, tp, cp, ep, refused", EP_CASES)
def test_expert_parallel_plan_launch_and_train_agree(tmp_path, capsys, nodes, per_node, strategy, tp, cp, ep,
                                                     refused):
    moe_dir = tmp_path / "moe"
    moe_dir.mkdir()
    (moe_dir / "config.json").write_text(json.dumps(_MOE))
    sets = _settings(tmp_path, moe_dir, strategy, tp, cp, None, False) + [f"parallel.ep={ep}"]
    try:
        row = plan(model=str(moe_dir), gpus=nodes * per_node, gpus_per_node=per_node, strategies=[strategy], tp=tp,
                   cp=cp, ep=ep, seq_len=384, precision="fp32").to_dict()["strategies"][0]
        planned = row.get("error")
    except UserError as e:
        planned = str(e)
    _agree(planned, capsys, tmp_path, sets, nodes, per_node, refused)
