"""`shardtune recipes` (list, cp), recipe-relative paths, and model ids in the local Hugging Face cache.

References: the repository's recipes/ folder (what the command lists and copies); the files written
to a temporary folder; huggingface_hub's own `snapshot_download(local_files_only=True)` on a fake cache
laid out as it writes one."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shardtune import cli
from shardtune.config import load_recipe
from shardtune.config.paths import recipe_paths
from shardtune.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"


def _run(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_recipes_lists_every_shipped_recipe(capsys):
    rc, out, _ = _run(["recipes"], capsys)
    assert rc == 0
    names = [line.split()[0] for line in out.splitlines()[1:] if line and not line.startswith("copy")]
    assert names == sorted(p.stem for p in RECIPES.glob("*.yaml"))
    assert "The demo: fine-tune a tiny Llama" in out  # tiny-cpu.yaml's first comment line
    assert _run(["recipes", "ls"], capsys)[1] == out


def test_shipped_recipes_are_package_data():
    """The package's shipped/ is the repository's recipes/ (a link setuptools copies into the wheel:
    pyproject's package-data takes **/*.yaml under shardtune/)."""
    from shardtune.recipes import SHIPPED

    assert SHIPPED.resolve() == RECIPES.resolve()
    assert '"**/*.yaml"' in (ROOT / "pyproject.toml").read_text()


def test_cp_copies_byte_for_byte_and_never_overwrites(tmp_path, capsys):
    rc, out, _ = _run(["recipes", "cp", "tiny-cpu", str(tmp_path / "mine.yaml")], capsys)
    assert rc == 0 and (tmp_path / "mine.yaml").read_bytes() == (RECIPES / "tiny-cpu.yaml").read_bytes()
    assert load_recipe(tmp_path / "mine.yaml").parallel.strategy == "zero3"
    rc, _, err = _run(["recipes", "cp", "tiny-cpu.yaml", str(tmp_path / "mine.yaml")], capsys)
    assert rc == 2 and "never overwrites" in err and err.count("\n") == 1
    rc, _, _ = _run(["recipes", "cp", "smollm2-dates", str(tmp_path)], capsys)  # a folder: DEST/NAME.yaml
    assert rc == 0 and (tmp_path / "smollm2-dates.yaml").is_file()
    rc, _, err = _run(["recipes", "cp", "tiny-cpus", str(tmp_path / "x.yaml")], capsys)
    assert rc == 2 and "did you mean 'tiny-cpu'" in err


def test_cp_notes_relative_paths_the_copy_loses(tmp_path, capsys):
    (RECIPES.parent / "data" / "smollm2-dates" / "train.jsonl").stat()  # the shipped recipe's data is here
    rc, out, _ = _run(["recipes", "cp", "smollm2-dates", str(tmp_path / "d.yaml")], capsys)
    assert rc == 0 and "data.path: '../data/smollm2-dates/train.jsonl' rewritten to" in out
    shipped, copy = load_recipe(RECIPES / "smollm2-dates.yaml"), load_recipe(tmp_path / "d.yaml")
    assert copy.data.path == shipped.data.path and Path(copy.data.path).is_file()  # the same file, found
    assert copy.model_dump(exclude={"data"}) == shipped.model_dump(exclude={"data"})


def test_cp_refuses_a_dangling_symlink_as_cp_does(tmp_path, capsys):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link.yaml").symlink_to(tmp_path / "elsewhere" / "target.yaml")
    rc, _, err = _run(["recipes", "cp", "tiny-cpu", str(tmp_path / "link.yaml")], capsys)
    assert rc == 2 and "dangling symlink" in err and err.count("\n") == 1
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_relative_paths_read_against_the_recipes_folder(tmp_path, monkeypatch):
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "train.jsonl").write_text('{"text": "hi"}\n')
    recipe = tmp_path / "exp" / "r.yaml"
    recipe.write_text("data:\n  path: train.jsonl\n  val_path: ./train.jsonl\noutput_dir: out\n")
    monkeypatch.chdir(tmp_path)  # another folder than the recipe's
    cfg = load_recipe(recipe)
    assert cfg.data.path == str(tmp_path / "exp" / "train.jsonl") == cfg.data.val_path
    assert cfg.run_dir == tmp_path / "exp" / "out"
    # a path given on the command line is the user's, relative to where they are
    assert load_recipe(recipe, ["data.path=x.jsonl"]).data.path == "x.jsonl"
    # a run folder's config.yaml (absolute paths) reads back the same from anywhere
    from shardtune.config import dump_config

    (tmp_path / "exp" / "out").mkdir()
    (tmp_path / "exp" / "out" / "config.yaml").write_text(dump_config(cfg))
    assert load_recipe(tmp_path / "exp" / "out" / "config.yaml").data == cfg.data


def test_a_missing_relative_path_names_it_as_written_and_resolved(tmp_path, monkeypatch):
    from shardtune.train.launcher.preflight import validate_for_launch

    (tmp_path / "sub").mkdir()
    (tmp_path / "data.jsonl").write_text('{"text": "hi"}\n')  # next to the cwd, not to the recipe
    recipe = tmp_path / "sub" / "r.yaml"
    recipe.write_text("data:\n  path: data.jsonl\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_recipe(recipe, [f"output_dir={tmp_path}/run"])
    assert recipe_paths(cfg) == {"data.path": ("data.jsonl", str(tmp_path / "sub" / "data.jsonl"))}
    with pytest.raises(UserError) as e:
        validate_for_launch(cfg, 1, 1)
    msg = str(e.value)
    assert "data.path 'data.jsonl'" in msg and repr(str(tmp_path / "sub" / "data.jsonl")) in msg and "\n" not in msg


def test_names_stay_names(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  name: tiny-llama\ndata:\n  path: someone/some-dataset\n  chat_template: chatml\n")
    cfg = load_recipe(recipe)
    assert (cfg.model.name, cfg.data.path, cfg.data.chat_template) == ("tiny-llama", "someone/some-dataset", "chatml")


def _fake_hub_cache(root: Path, repo_id: str, commit: str = "0" * 40) -> Path:
    """A model in huggingface_hub's cache layout: models--O--N/{refs/main, snapshots/<commit>/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    from shardtune.catalog.models import MODELS

    (snap / "config.json").write_text(json.dumps(MODELS["tiny-llama"]["config"]))
    return snap


def test_model_id_in_the_local_hub_cache(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    snap = _fake_hub_cache(cache, "someone/tiny-model")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    cfg = load_recipe(None, ["model.name=someone/tiny-model"])
    want = huggingface_hub.snapshot_download("someone/tiny-model", cache_dir=str(cache), local_files_only=True)
    assert cfg.model.name == str(snap) and os.path.samefile(cfg.model.name, want)
    from shardtune.train.launcher.preflight import validate_for_launch

    validate_for_launch(load_recipe(None, ["model.name=someone/tiny-model", f"output_dir={tmp_path}/run",
                                           "train.backend=gloo"]), 1, 1)
    # not in the cache: the launch check says where it looked
    with pytest.raises(UserError, match="nor a model in the local Hugging Face cache") as e:
        validate_for_launch(load_recipe(None, ["model.name=someone/other", f"output_dir={tmp_path}/run"]), 1, 1)
    assert str(cache) in str(e.value)
