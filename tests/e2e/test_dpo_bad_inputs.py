"""Bad preference data is one line, exit 2, before any process starts (`shardtune train`)."""
from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = [pytest.mark.e2e]
GOOD = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
BAD = [
    ([GOOD, {"prompt": "3+3=", "chosen": "6", "rejected": ""}], "line 2: the 'rejected' side is empty"),
    ([GOOD, {"prompt": "3+3=", "chosen": "6"}], "line 2: train.objective=dpo needs 'prompt', 'chosen' and 'rejected'"),
    ([{"prompt": "2+2=", "chosen": "4", "rejected": "4"}] * 3, "chosen == rejected in every one of its 3 pairs"),
    ([{"prompt": "2+2=", "response": "4"}] * 3, "columns ['prompt', 'response']"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
     "columns ['messages']"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rows, needle", BAD, ids=["empty side", "missing side", "all equal", "sft rows", "chat rows"])
def test_bad_pairs_exit_2_one_line_before_any_process(tmp_path, monkeypatch, capsys, rows, needle):
    from shardtune import cli

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{name: tiny-llama, init: random}}\ndata: {{path: {data}, tokenizer: byte, "
                      "cache_dir: null}\ntrain: {objective: dpo, micro_batch: 1, seq_len: 32}\n")

    def no_process(*a, **k):
        raise AssertionError("a process was started for bad input")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    rc = cli.main(["train", str(recipe), "--nproc", "2", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err, err
