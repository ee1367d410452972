"""rl.reward (train/core/rewards.py): the built-ins on hand-made completions, a user's file loaded from
the recipe's path only, and a reward that raises or returns a non-number as one line naming the rank
and the prompt."""
from __future__ import annotations

import pytest

from shardtune.config import RLConfig
from shardtune.errors import UserError
from shardtune.train.core.rewards import Rewards, check_reward_file

COMPLETIONS = ["09/03/2017", " 2017-03-09 is a day", "9/3/2017"]
IDS = [[1] * 11, [1] * 16, [1] * 9]


def score(*rewards, max_new=16, **columns):
    r = Rewards(RLConfig(reward=list(rewards), max_new_tokens=max_new))
    return r, r.score(["p"] * 3, COMPLETIONS, columns, IDS, rank=3)


def test_builtins_by_hand():
    r, per_fn = score({"name": "exact_match", "column": "answer"},
                      {"name": "regex", "pattern": r"\d{2}/\d{2}/\d{4}", "weight": 2.0},
                      {"name": "regex", "label": "bare", "pattern": r"[\d/-]+", "full": True},
                      {"name": "length", "target": 11, "weight": 0.5}, answer=["09/03/2017"] * 3)
    assert per_fn == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 1.0], [1.0, 1 - 5 / 16, 1 - 2 / 16]]
    assert r.total(per_fn) == [1 + 2 + 1 + 0.5, 0.5 * (1 - 5 / 16), 1 + 0.5 * (1 - 2 / 16)]
    assert r.labels == ["exact_match", "regex", "bare", "length"]


def test_user_file_from_its_path(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("import numpy as np\ndef lens(prompts, completions, **kw):\n"
                 "    return [np.float32(len(c)) for c in completions]\n")
    _, per_fn = score({"name": f"{f}:lens"})
    assert per_fn == [[10.0, 20.0, 8.0]]


@pytest.mark.parametrize("body, needle", [
    ("raise KeyError('answer')", "rank 3: reward r raised KeyError: 'answer' on prompt 'p'"),
    ("return [float('nan')] * len(completions)", "rank 3: reward r returned nan on prompt 'p', not a finite number"),
    ("return None", "rank 3: reward r returned NoneType on prompt 'p', not a list of 3 numbers"),
    ("return ['1'] * len(completions)", "rank 3: reward r returned '1' on prompt 'p'"),
])
def test_a_bad_reward_is_one_line_naming_rank_and_prompt(tmp_path, body, needle):
    f = tmp_path / "bad.py"
    f.write_text(f"def r(prompts, completions, **kw):\n    {body}\n")
    with pytest.raises(UserError) as e:
        score({"name": f"{f}:r"})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_reward_files_checked_before_any_process(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        check_reward_file(f"{tmp_path}/none.py:r")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "r.py").write_text("def r(p, c, **k):\n    return [0.0] * len(c)\n")
    with pytest.raises(UserError, match="inside the model folder"):
        check_reward_file(f"{tmp_path}/model/r.py:r", model_dir=str(tmp_path / "model"))
    with pytest.raises(ValueError, match="unknown reward"):
        RLConfig(reward=[{"name": "bleu"}])
    with pytest.raises(ValueError, match="give each a label"):
        RLConfig(reward=[{"name": "length", "target": 3}, {"name": "length", "target": 4}])
