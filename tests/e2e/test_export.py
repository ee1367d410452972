"""`shardtune export CHECKPOINT OUT` → `AutoModelForCausalLM.from_pretrained(OUT)` gives the trained
model's logits.

One real training run (`python -m shardtune.train`, one process, zero3 (FSDP2), fp32, a checkpoint
at step 4, export at the end). Two independent references:
- the loss the trainer logged at step 5 is the step-4 weights' loss on the step-5 batch; the
  exported step-4 model must give the same loss on that batch (recomputed here from the data
  loader state saved in the checkpoint, with torch's cross_entropy);
- torch's own DCP reader (`dcp.load` with its default planner into a plain HF model) must give
  the same logits as the exported folder (max abs diff ≤ 1e-5).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _runs import dcp_model

pytestmark = [pytest.mark.e2e]
RECIPE = """
name: export
model: {name: tiny-llama}
data: {generated_examples: 200}
parallel: {strategy: zero3, precision: fp32}
optim: {lr: 0.002, warmup_steps: 2}
train: {micro_batch: 4, seq_len: 64, max_steps: 5, timeout_s: 60}
checkpoint: {every: 4, export_hf: true}
"""


@pytest.fixture
def run(shared_one_process_run) -> Path:
    """One run for this file and tests/e2e/test_generate.py (the same RECIPE): read-only, copy to change."""
    return shared_one_process_run(RECIPE)


def _step5_batch(run: Path) -> dict:
    """The batch step 5 trained on: the loader restored from step_4's data position."""
    from shardtune.config import load_recipe
    from shardtune.train.data.dataset import build_dataloader, build_tokenizer

    cfg = load_recipe(run / "config.yaml")
    loader = build_dataloader(cfg.data, cfg.train, build_tokenizer(cfg.data, cfg.model.name), 0, 1, cfg.train.seed)
    loader.load_state_dict(json.loads((run / "checkpoints" / "step_4" / "trainer.json").read_text())["data"])
    return next(loader)


@pytest.mark.timeout(240)
def test_export_cli_sharded_folder_loads_with_the_trained_logits(run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from shardtune import cli

    out = tmp_path / "hf"
    assert cli.main(["export", str(run / "checkpoints" / "step_4"), str(out), "--max-shard-size", "1MB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    # the largest tensor (embed/lm_head: 264 x 128 fp32 = 135 KB) is far below 1 MB: every shard fits
    assert all((out / f).stat().st_size <= 10**6 + 10**4 for f in files)  # + safetensors header
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    batch = _step5_batch(run)
    with torch.no_grad():
        # use_cache False: packed rows get transformers' block-diagonal mask only without a KV cache,
        # as in training (the export's config.json keeps the source's use_cache: true)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        ref = dcp_model(run / "checkpoints" / "step_4", out)(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    logged = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert abs(loss.item() - logged[5]) <= 1e-5, (loss.item(), logged[5])
    assert (logits - ref).abs().max().item() <= 1e-5


@pytest.mark.timeout(240)
def test_export_at_the_end_of_training_and_tokenizer(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.train.data.tokenizer import ByteTokenizer

    out = run / "hf_export"
    assert (out / "model.safetensors").is_file()  # 3.2 MB < 5 GB: one file, HF's unsharded name
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.arange(0, 40).reshape(2, 20)
    with torch.no_grad():
        diff = (model(ids).logits - dcp_model(run / "checkpoints" / "step_5", out)(ids).logits).abs().max()
    assert diff.item() <= 1e-5
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("héllo")["input_ids"] == [256] + ByteTokenizer().encode("héllo")


@pytest.mark.timeout(60)
def test_export_memory_bound_is_one_shard(run, tmp_path, monkeypatch):
    """Each read asks DCP for one shard's tensors only: the bytes requested at once never pass the
    limit (here 300 kB, every tensor smaller)."""
    import torch.distributed.checkpoint as dcp

    from shardtune.train.durable.export import export_checkpoint

    requested = []
    real_load = dcp.load

    def spy(state_dict, **kw):
        requested.append(sum(t.numel() * t.element_size() for t in state_dict.values()))
        return real_load(state_dict, **kw)

    monkeypatch.setattr(dcp, "load", spy)
    export_checkpoint(run / "checkpoints" / "step_4", tmp_path / "hf", max_shard_bytes=300_000)
    assert len(requested) > 5 and max(requested) <= 300_000


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, needle", [(["{tmp}/nope", "{tmp}/out"], "not a complete shardtune checkpoint"),
                                          (["{ckpt}", "{ckpt}"], "inside the checkpoint"),
                                          (["{ckpt}", "{run}"], "not empty"),
                                          (["{ckpt}", "{tmp}/o", "--max-shard-size", "5XB"], "not understood")])
def test_export_bad_input_is_one_line_exit_2(run, tmp_path, capsys, args, needle):
    from shardtune import cli

    args = [a.format(tmp=tmp_path, ckpt=run / "checkpoints" / "step_4", run=run) for a in args]
    assert cli.main(["export", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def _tamper(ckpt: Path, payload: bytes) -> None:
    """Write `payload` as .metadata and, as an attacker would, its size and CRC-32 into the step's
    metadata, so the checksum check passes and the allow-list unpickler is what must refuse it."""
    from shardtune.train.durable import integrity

    (ckpt / ".metadata").write_bytes(payload)
    meta = json.loads((ckpt / "shardtune_checkpoint.json").read_text())
    meta["files"][".metadata"] = [len(payload), integrity.crc32_file(ckpt / ".metadata")]
    (ckpt / "shardtune_checkpoint.json").write_text(json.dumps(meta))


@pytest.mark.timeout(60)
def test_a_tampered_metadata_pickle_is_refused_not_executed(run, tmp_path, capsys):
    """DCP's .metadata is a pickle: one that calls a function must be refused before it runs."""
    import pickle
    import shutil

    from shardtune import cli

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    ckpt = tmp_path / "step_4"
    shutil.copytree(run / "checkpoints" / "step_4", ckpt)
    _tamper(ckpt, pickle.dumps(Evil()))
    assert cli.main(["export", str(ckpt), str(tmp_path / "out")]) == 2
    assert "refusing to load it" in capsys.readouterr().err
    assert not (tmp_path / "pwned").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", [
    "torch._strobelight.cli_function_profiler.subprocess.Popen",  # a class reached through attributes
    "FileSystemReader",  # a DCP class, but no dataclass: its constructor opens paths
    "Path",  # imported into a DCP module, defined in pathlib
])
def test_metadata_naming_a_non_dcp_class_through_a_dcp_module_is_refused(run, tmp_path, capsys, name):
    """Protocol 4's STACK_GLOBAL resolves dotted names: the allow-list must not follow them (issue 15)."""
    import pickle
    import shutil

    from shardtune import cli

    module = "torch.distributed.checkpoint.filesystem"
    marker = tmp_path / "pwned"
    # STACK_GLOBAL(module, name), then call it with one argument: Popen(["touch", marker])
    payload = (pickle.PROTO + bytes([4]) + pickle.SHORT_BINUNICODE + bytes([len(module)]) + module.encode()
               + pickle.SHORT_BINUNICODE + bytes([len(name)]) + name.encode() + pickle.STACK_GLOBAL
               + pickle.MARK + pickle.BINUNICODE + len(b"touch").to_bytes(4, "little") + b"touch"
               + pickle.BINUNICODE + len(str(marker).encode()).to_bytes(4, "little") + str(marker).encode()
               + pickle.LIST + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
    ckpt = tmp_path / "step_4"
    shutil.copytree(run / "checkpoints" / "step_4", ckpt)
    _tamper(ckpt, payload)
    assert cli.main(["export", str(ckpt), str(tmp_path / "out")]) == 2
    assert "refusing to load it" in capsys.readouterr().err
    assert not marker.exists()


# ---------------------------------------------------------------- the export never damages what is there
def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.timeout(180)
def test_reexport_replaces_only_its_own_unchanged_files_and_names_the_users(run, tmp_path, capsys):
    """The manifest lists each written file with its SHA-256 (hashlib here): a re-export (CLI, or the
    end-of-run overwrite=True) replaces or removes only those still as written (old shards go); a
    file the user added or edited (config.json) stays byte for byte and is named in one line; an
    edited weights file is moved aside in the folder, never deleted."""
    import hashlib

    from shardtune import cli
    from shardtune.train.durable.export import MANIFEST, export_checkpoint

    out = tmp_path / "hf"
    export_checkpoint(run / "checkpoints" / "step_4", out, max_shard_bytes=10**6)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    files = json.loads((out / MANIFEST).read_text())["files"]
    assert sorted(files) == sorted(set(_tree(out)) - {MANIFEST})
    for name, entry in files.items():
        assert entry["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest(), name
    capsys.readouterr()
    assert cli.main(["export", str(run / "checkpoints" / "step_4"), str(out)]) == 0  # onto an earlier export
    assert not list(out.glob("model-*")) and (out / "model.safetensors").is_file()
    assert sorted(json.loads((out / MANIFEST).read_text())["files"]) == sorted(set(_tree(out)) - {MANIFEST})
    assert [p.name for p in tmp_path.iterdir()] == ["hf"] and "kept" not in capsys.readouterr().err

    config = json.loads((out / "config.json").read_text()) | {"max_position_embeddings": 256}
    (out / "config.json").write_text(json.dumps(config))  # the user's edit
    (out / "notes.txt").write_text("my notes")
    (out / "sub").mkdir()
    (out / "sub" / "eval.json").write_text("{}")
    users = {n: b for n, b in _tree(out).items() if n in ("config.json", "notes.txt", "sub/eval.json")}
    export_checkpoint(run / "checkpoints" / "step_5", out, overwrite=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(n in err[0] for n in users), err
    assert {n: b for n, b in _tree(out).items() if n in users} == users  # kept, byte for byte
    manifest = json.loads((out / MANIFEST).read_text())
    assert "config.json" not in manifest["files"] and "config.json" in manifest["kept"]

    weights = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(weights[:-4] + b"\0\0\0\0")
    edited = (out / "model.safetensors").read_bytes()
    export_checkpoint(run / "checkpoints" / "step_5", out, overwrite=True)
    aside = list(out.glob("model.safetensors.previous-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == edited
    assert (out / "model.safetensors").read_bytes() == weights
    assert any(aside[0].name in line for line in capsys.readouterr().err.splitlines())


@pytest.mark.timeout(180)
def test_an_export_onto_a_link_fills_its_target_and_generate_refuses_altered_weights(run, tmp_path, capsys):
    """OUT a symlink to a folder: the files go into the link's target, the link stays, nothing else
    appears beside it. Weights changed after the export: `shardtune generate` is one line, exit 2,
    and a config.json the user edits is no reason to refuse."""
    from shardtune import cli

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert cli.main(["export", str(run / "checkpoints" / "step_4"), str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    assert (tmp_path / "real" / "model.safetensors").is_file() and (tmp_path / "real" / "config.json").is_file()
    cfg = tmp_path / "real" / "config.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"use_cache": True}))
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path / "link"), "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    weights = tmp_path / "real" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of one weight: loads fine, answers from altered weights
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path / "link"), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1 and "SHA-256" in out.err, out
    assert "delete" not in out.err and "--trust-unverified" in out.err

    def generate(*flags) -> tuple[int, str]:
        capsys.readouterr()
        rc = cli.main(["generate", str(tmp_path / "link"), "--prompt", "hi", "--max-new-tokens", "2", *flags])
        return rc, capsys.readouterr().err

    assert generate("--trust-unverified")[0] == 0
    manifest = tmp_path / "real" / ".shardtune_export.json"
    kept = manifest.read_text()
    manifest.write_text(kept[:40])  # unparseable (issue 42 item 4): not "no manifest"
    rc, err = generate()
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "cannot be read" in err, err
    assert generate("--trust-unverified")[0] == 0
    manifest.unlink()  # gone, the weights still altered: the header's record of the tensor bytes refuses
    rc, err = generate()
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "the SHA-256 its header records differs" in err, err
    assert "delete" not in err and generate("--trust-unverified")[0] == 0
    data[-1] ^= 0x01  # the weights as exported, no manifest: they verify by their header
    weights.write_bytes(bytes(data))
    assert generate()[0] == 0


@pytest.mark.timeout(120)
def test_a_failed_export_leaves_the_folder_as_it_was_and_no_temporary(run, tmp_path, monkeypatch):
    import safetensors.torch

    from shardtune.errors import UserError
    from shardtune.train.durable.export import export_checkpoint

    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(UserError, match="disk full while writing the export"):  # one line, not a traceback
        export_checkpoint(run / "checkpoints" / "step_4", out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and _tree(out) == {"notes.txt": b"keep me"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_export_files_have_the_mode_of_any_file_the_user_makes(run, tmp_path, umask):
    """Every exported file (safetensors writes 0600 by itself) gets the mode a plain `open(..., "w")`
    gives under the same umask."""
    from shardtune.train.durable.export import export_checkpoint

    old = os.umask(umask)
    try:
        (tmp_path / "reference").write_text("x")
        export_checkpoint(run / "checkpoints" / "step_4", tmp_path / "hf", max_shard_bytes=10**6)
    finally:
        os.umask(old)
    want = (tmp_path / "reference").stat().st_mode & 0o777
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir() if p.is_file()}
    assert len(modes) > 4 and set(modes.values()) == {want}, (oct(want), {k: oct(v) for k, v in modes.items()})
