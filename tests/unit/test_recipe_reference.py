"""docs/recipe.md is the schema's reference as generated now, and lists every key with its help;
unknown keys suggest the key meant (by the last segment, config/keys.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from shardtune.config import RunConfig, load_recipe
from shardtune.config.keys import all_keys
from shardtune.config.reference import render
from shardtune.errors import UserError

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipe.md"


def test_docs_recipe_md_is_current():
    assert DOC.read_text() == render(), "docs/recipe.md is stale: python -m shardtune.config.reference > docs/recipe.md"


def test_every_key_documented_with_type_default_and_help():
    rows = {line.split("|")[1].strip().strip("`"): [c.strip() for c in line.split("|")[2:5]]
            for line in DOC.read_text().splitlines() if line.startswith("| `")}
    leaves = [k for k in all_keys(RunConfig) if k not in RunConfig.model_fields or k in ("name", "output_dir")]
    sections = [k for k in RunConfig.model_fields if k not in ("name", "output_dir")]
    for key in leaves:
        if key in sections:
            continue
        assert key in rows, key
        typ, default, what = rows[key]
        assert typ and default and what, key
    # the defaults written are the schema's: a default config dumped to YAML agrees key by key
    dumped = RunConfig().model_dump(mode="json")
    assert rows["optim.lr"][1] == f"`{dumped['optim']['lr']}`" and rows["train.seq_len"][1] == "`128`"


@pytest.mark.parametrize("key, meant", [
    ("optim.learning_rate", "optim.lr"), ("train.lr", "optim.lr"), ("optim.lrr", "optim.lr"),
    ("optim.min_lr", "optim.min_lr_ratio"), ("train.gradient_accumulation_steps", "train.grad_accum"),
    ("train.max_seq_length", "train.seq_len"), ("data.val_splt", "data.val_split"), ("modle", "model"),
    ("lora.rnak", "lora.rank"), ("train.batch_size", "train.micro_batch")])
def test_unknown_key_suggests_the_key_meant(key, meant):
    with pytest.raises(UserError) as e:
        load_recipe(None, [f"{key}=1"])
    assert f"(did you mean {meant!r}?)" in str(e.value)


@pytest.mark.parametrize("key", ["foo.bar", "optim.zzz"])
def test_nothing_close_suggests_nothing(key):
    with pytest.raises(UserError) as e:
        load_recipe(None, [f"{key}=1"])
    assert "did you mean" not in str(e.value)
