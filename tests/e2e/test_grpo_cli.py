"""`shardtune train` with `train.objective: grpo` on the real SmolLM2 fixture (cut to 2 layers):
zero3 on 2 processes against 1 process with the same global batch (same completions, the same
numbers), and step 1 against GRPO written here in plain torch on one unsharded transformers model
(Shao et al. 2024 eq. 3 with μ = 1: ratio 1, so the gradient is −mean_i A_i · mean_t ∇log π(o_it);
the advantages and rewards recomputed here from the completions' text; the full temperature-scaled
logits). Also a user's reward file loaded from the recipe's path, β > 0 (the reference and its KL),
LoRA (2 ranks = 1 process; its reference the base with the adapters off), hsdp (2 replicas = 1 process),
and the bad inputs of the issue (one line, exit 2).
"""
from __future__ import annotations

import json
import re
import statistics
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _cli import refused_before_any_process, shardtune_cli

from shardtune.testing.smollm2 import cut_folder

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e]
STEPS, G, MAX_NEW, TEMP, LR, BETA = 2, 4, 8, 0.9, 1e-4, 0.04
RUNS = pytest.mark.timeout(900)  # whichever test comes first pays the shared fixture's 5 launches

REWARD_PY = '''
def spaces(prompts, completions, **columns):
    """A tenth of the spaces in each completion."""
    return [c.count(" ") / 10 for c in completions]
'''


def recipe(folder: Path, out: Path, reward_file: Path, micro: int, accum: int) -> str:
    data = REPO / "data" / "smollm2-grpo"
    val = out.parent / "val.jsonl"  # 4 held-out prompts: greedy answers before and after
    val.write_text("".join((data / "val.jsonl").read_text().splitlines(keepends=True)[:4]))
    return f"""name: grpo-test
output_dir: {out}
model: {{name: {folder}, init: pretrained}}
data: {{path: {data / 'train.jsonl'}, val_path: {val}, shuffle: false, cache_dir: null}}
parallel: {{strategy: zero3, precision: fp32}}
optim: {{lr: {LR}, betas: [0.9, 0.95], weight_decay: 0.0, grad_clip: 1.0, warmup_steps: 0, schedule: constant}}
train: {{micro_batch: {micro}, grad_accum: {accum}, seq_len: 64, max_steps: {STEPS}, objective: grpo, threads: 1,
        log_every: 1, eval_every: {STEPS}}}
rl:
  num_generations: {G}
  max_new_tokens: {MAX_NEW}
  temperature: {TEMP}
  beta: {BETA}
  reward:
    - {{name: regex, pattern: ',', weight: 1.0}}
    - {{name: '{reward_file}:spaces', weight: 0.5}}
checkpoint: {{save_final: false}}
"""


RUN_DIRS: dict[str, tuple[Path, tuple]] = {}  # each run's folder and overrides (memory.json's rl rows below)


def train(tmp: Path, folder: Path, reward_file: Path, nproc: int, micro: int, accum: int, *overrides: str):
    """(metrics records, completions rows, stdout) of one `shardtune train` run."""
    import sys

    from shardtune.processes import run_bounded

    tmp.mkdir(parents=True, exist_ok=True)
    RUN_DIRS[tmp.name] = (tmp, overrides)
    (tmp / "recipe.yaml").write_text(recipe(folder, tmp / "run", reward_file, micro, accum))
    cmd = [sys.executable, "-m", "shardtune.cli", "train", str(tmp / "recipe.yaml"), "--nproc", str(nproc), *overrides]
    proc = run_bounded(cmd, timeout_s=400, cwd=REPO, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    read = lambda name: [json.loads(line) for line in (tmp / "run" / name).read_text().splitlines()]  # noqa: E731
    return read("metrics.jsonl"), read("completions.jsonl"), proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    reward_file = tmp / "my_rewards.py"
    reward_file.write_text(REWARD_PY)
    folder = cut_folder(2)
    two = train(tmp / "two", folder, reward_file, nproc=2, micro=1, accum=1)
    one = train(tmp / "one", folder, reward_file, nproc=1, micro=1, accum=2)
    no_val = ("data.val_path=null", "train.eval_every=0")
    hsdp = train(tmp / "hsdp", folder, reward_file, 2, 1, 1, "parallel.strategy=hsdp", "parallel.hsdp_shard_size=1",
                 *no_val)  # 2 replicas of a shard group of 1: the replica all-reduce
    return folder, two, one, lora_runs(tmp, folder, reward_file, no_val), hsdp


@RUNS
def test_hsdp_two_ranks_equal_one_process(runs):
    _, _, (m1, c1, _), _, (mh, ch, _) = runs
    strip = lambda rows: [{k: v for k, v in r.items() if k != "advantage"} for r in rows]  # noqa: E731
    assert strip(ch) == strip(c1)
    for a, b in zip(mh, m1, strict=True):
        for key in ("loss", "grad_norm", "reward", "reward_std", "completion_len", "clip_frac", "entropy", "kl"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])


def lora_runs(tmp: Path, folder: Path, reward_file: Path, no_val: tuple):
    """The same under LoRA (2 ranks zero3, then 1 process): the base frozen, β > 0's reference the base."""
    lora = ("lora.rank=8", "lora.alpha=32", "optim.lr=0.003", *no_val)
    return (train(tmp / "two_lora", folder, reward_file, 2, 1, 1, *lora),
            train(tmp / "one_lora", folder, reward_file, 1, 1, 2, *lora))


@RUNS
def test_lora_two_ranks_equal_one_process_reference_is_the_base(runs):
    """LoRA's B starts at 0, so step 1's policy is the base: the full run's completions and loss, KL 0
    (the reference is the base with the adapters off); step 2 the adapters moved: KL > 0."""
    _, (m_full, c_full, _), _, ((m2, c2, out2), (m1, c1, _)), _ = runs
    strip = lambda rows: [{k: v for k, v in r.items() if k != "advantage"} for r in rows]  # noqa: E731
    assert strip(c2) == strip(c1) and len(c2) == STEPS * 2 * G
    for a, b in zip(m2, m1):
        for key in ("loss", "grad_norm", "reward", "reward_std", "completion_len", "clip_frac", "entropy", "kl"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])
    assert strip(r for r in c2 if r["step"] == 1) == strip(r for r in c_full if r["step"] == 1)
    assert abs(m2[0]["loss"] - m_full[0]["loss"]) < 1e-6 and abs(m2[0]["reward"] - m_full[0]["reward"]) < 1e-6
    assert abs(m2[0]["kl"]) < 1e-9 and m2[1]["kl"] > 1e-7, (m2[0]["kl"], m2[1]["kl"])
    assert "reference: the base (LoRA adapters off)" in out2


@RUNS
def test_two_ranks_equal_one_process(runs):
    _, (m2, c2, out2), (m1, c1, _), _, _ = runs
    assert [r["step"] for r in m2] == list(range(1, STEPS + 1))
    strip = [{k: v for k, v in r.items() if k != "advantage"} for r in c2]
    assert strip == [{k: v for k, v in r.items() if k != "advantage"} for r in c1]  # the same completions, rewards
    assert len(c2) == STEPS * 2 * G
    for a, b in zip(m2, m1):
        for key in ("loss", "grad_norm", "reward", "reward_std", "reward/regex", "reward/spaces", "completion_len",
                    "clip_frac", "entropy", "kl"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])
    assert m2[-1]["kl"] > 0 and m2[0]["grad_norm"] > 0  # step 2 left the reference: the comparison means something
    assert "user reward code loaded from" in out2 and "my_rewards.py:spaces" in out2
    assert "held-out prompts: reward before training" in out2 and "val_reward" in m2[-1]


@RUNS
def test_memory_json_says_the_recipes_grpo_settings(runs):
    """memory.json's effective rl rows on every rank (read from the built objective: the clip's upper bound
    and the reward scaling resolved, the rewards as built) against tests/e2e/test_effective.py's TABLE,
    which writes each row's value from the recipe: the 2-rank runs, full and LoRA."""
    from test_effective import TABLE

    from shardtune.config import load_recipe

    rows = {k: v for k, v in TABLE.items() if k.startswith("rl.") and isinstance(v, tuple)}
    assert len(rows) == 11, sorted(rows)
    for name in ("two", "two_lora"):
        tmp, overrides = RUN_DIRS[name]
        cfg = load_recipe(tmp / "recipe.yaml", list(overrides))
        memory = json.loads((tmp / "run" / "memory.json").read_text())
        assert [r["effective"] for r in memory["per_rank"]] == [memory["effective"]] * 2
        want = {k: read(cfg) for k, (_, read) in rows.items()}
        assert {k: memory["effective"][key] for k, (key, _) in rows.items()} == want, name
        assert want["rl.reward"] == [["regex", 1.0], ["spaces", 0.5]] and want["rl.epsilon_high"] == 0.2, want
        assert (want["rl.beta"], want["rl.num_generations"], want["rl.scale_rewards"]) == (BETA, G, True), want


@RUNS
def test_step_one_equals_plain_torch_grpo(runs):
    """Step 1's rewards, loss and gradient norm (before clipping) from the completions' ids, independently."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, (m2, c2, _), _, _, _ = runs
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    rows = [r for r in c2 if r["step"] == 1]
    total = 0.0
    rewards_all = []
    for slot in sorted({r["slot"] for r in rows}):
        group = [r for r in rows if r["slot"] == slot]
        rewards = [float("," in r["completion"]) + 0.5 * r["completion"].count(" ") / 10 for r in group]
        rewards_all += rewards
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
        head = list(tok.apply_chat_template([{"role": "user", "content": group[0]["prompt"]}], tokenize=True,
                                            add_generation_prompt=True, return_dict=True)["input_ids"])
        for r, reward in zip(group, rewards):
            adv = (reward - mean) / (std + 1e-4)
            ids = torch.tensor([head + r["completion_ids"]])
            logp = F.log_softmax(model(input_ids=ids).logits[0, :-1].float() / TEMP, -1)
            token = logp.gather(1, ids[0, 1:, None])[len(head) - 1:, 0]  # the completion's tokens
            total = total - adv * torch.exp(token - token.detach()).mean()  # KL: 0 at step 1 (policy = reference)
    loss = total / len(rows)
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    assert abs(m2[0]["reward"] - statistics.fmean(rewards_all)) < 1e-6
    assert abs(m2[0]["loss"] - float(loss)) < 1e-6
    assert abs(m2[0]["grad_norm"] - float(norm)) <= 1e-4 * float(norm), (m2[0]["grad_norm"], float(norm))


def _bad(tmp: Path, monkeypatch, capsys, *override: str, reward: Path | None = None) -> str:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "r.yaml").write_text(recipe(cut_folder(2), tmp / "run", reward or tmp / "absent.py", 1, 1))
    return refused_before_any_process(monkeypatch, capsys, ["train", tmp / "r.yaml", "--nproc", "2", *override])


@pytest.mark.timeout(120)
def test_bad_inputs_one_line_before_any_process(tmp_path, monkeypatch, capsys):
    assert "absent.py" in _bad(tmp_path / "a", monkeypatch, capsys)
    ok = tmp_path / "ok.py"
    ok.write_text(REWARD_PY)
    args = dict(reward=ok)
    assert "num_generations" in _bad(tmp_path / "b", monkeypatch, capsys, "rl.num_generations=1", **args)
    assert "unknown reward 'bleu'" in _bad(tmp_path / "c", monkeypatch, capsys, "rl.reward=[{name: bleu}]", **args)
    assert "acts under train.objective grpo" in _bad(tmp_path / "d", monkeypatch, capsys, "train.objective=sft",
                                                      **args)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "a?", "answer": "b"}\n' * 4)
    assert "needs a 'prompt' column" in _bad(tmp_path / "e", monkeypatch, capsys, f"data.path={rows}",
                                             "data.val_path=null", "train.eval_every=0", **args)
    assert "parallel.tp > 1" in _bad(tmp_path / "f", monkeypatch, capsys, "parallel.tp=2", **args)


@pytest.mark.timeout(200)
def test_a_reward_that_returns_a_non_number_names_the_rank_and_prompt(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def r(prompts, completions, **kw):\n    return ['x' for _ in completions]\n")
    (tmp_path / "r.yaml").write_text(recipe(cut_folder(2), tmp_path / "run", bad, 1, 1).replace(":spaces", ":r"))
    proc = shardtune_cli("train", tmp_path / "r.yaml", "--nproc", "1", "data.val_path=null", "train.eval_every=0",
                         stderr=subprocess.PIPE)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(r"rank 0: reward r returned 'x' on prompt 'Write the date", proc.stderr), proc.stderr
