"""Bad inputs through the real CLI (`shardtune train`, in process, torchrun's start forbidden): each is exit 2,
exactly one stderr line, before any process starts, and the run folder is left as it was."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
pytestmark = [pytest.mark.e2e]
_CFG = {"model_type": "llama", "vocab_size": 264, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256}


def _folder(root: Path, name: str, config: dict | None = _CFG, files: dict | None = None) -> Path:
    d = root / name
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    for fname, data in (files or {}).items():
        (d / fname).write_bytes(data)
    return d


def _safetensors(tensors: dict[str, list[int]]) -> bytes:
    """A valid safetensors file written by hand (the format's spec: u64 header length, JSON, data)."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        n = 4
        for s in shape:
            n *= s
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + bytes(offset)


def _saved(root: Path, name: str, edit: dict | None = None, files: dict | None = None) -> Path:
    """A tiny random Llama of _CFG saved by transformers (safetensors, the byte tokenizer's files
    aside), then its config.json edited by `edit` and `files` written over it."""
    from shardtune.errors import quiet_library_notices

    quiet_library_notices()  # as the CLI does, before transformers imports torchao
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    d = root / name
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in _CFG.items() if k != "model_type"})).save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **(edit or {})}))
    for fname, data in (files or {}).items():
        (d / fname).write_bytes(data)
    return d


def _nan_folder(root: Path) -> Path:
    d = _folder(root, "nan", None)
    (d / "config.json").write_text(json.dumps({**_CFG, "rms_norm_eps": 1e-5}).replace("1e-05", "NaN"))
    return d


def _cases(root: Path) -> list[tuple[list[str], str]]:
    recipe_latin1 = root / "latin1.yaml"
    recipe_latin1.write_bytes(b"name: caf\xe9\n")
    recipe_dup = root / "dup.yaml"
    recipe_dup.write_text("train:\n  max_steps: 3\n  max_steps: 4\n")
    recipe_newline = root / "nl.yaml"
    recipe_newline.write_text('name: "run\\nrm -rf ~"\n')
    auto = "model.init=auto"
    index = json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}).encode()
    wrong_shape = _safetensors({"model.embed_tokens.weight": [100, 64]})
    return [
        (["train.max_steps=true"], "is a boolean"),
        (["optim.lr=.inf"], "finite"),
        (["optim.betas=[0.9, 1.5]"], "[0, 1)"),
        (["parallel.hsdp_shard_size=2"], "applies to hsdp only"),
        (["train.seq_len=100000"], "max_position_embeddings"),
        (["train.backend=nccl"], "needs CUDA"),
        (["data.generated_examples=3"], "fewer than one global batch"),
        (["lora.rank=4", "lora.target_modules=[nope_proj]"], "nope_proj"),
        ([f"model.name={_folder(root, 'noconfig', None)}"], "has no config.json"),
        ([f"model.name={_folder(root, 'badjson', None, {'config.json': b'{not json'})}"], "not valid JSON"),
        ([f"model.name={_folder(root, 'bert', {**_CFG, 'model_type': 'nosuchtype'})}"], "model_type 'nosuchtype'"),
        ([auto, f"model.name={_folder(root, 'pickle', files={'pytorch_model.bin': b'x'})}"],
         "pickle weights only"),
        ([auto, f"model.name={_folder(root, 'corrupt', files={'model.safetensors': b'garbage!'})}"],
         "not a readable safetensors"),
        ([auto, f"model.name={_folder(root, 'truncated', files={'model.safetensors': wrong_shape[:-10]})}"],
         "not a readable safetensors"),
        ([auto, f"model.name={_folder(root, 'shape', files={'model.safetensors': wrong_shape})}"],
         "has shape [100, 64]"),
        (["--recipe-file", str(recipe_latin1)], "not UTF-8"),
        (["--recipe-file", str(recipe_dup)], "given twice"),
        # out of range: seeds torch's generators cannot take, a year-plus timeout (timedelta overflows at
        # 1e300), step counts past any run, an unknown GPU, strings where counts go
        (["train.seed=-1"], "greater than or equal to 0"),
        ([f"train.seed={2**64}"], "less than 4294967296"),
        (["train.timeout_s=1e300"], "less than or equal to 31536000"),
        ([f"train.max_steps={10**23}"], "less than or equal to 1000000000"),
        (["train.gpu=h100-8gb"], "unknown GPU 'h100-8gb'"),
        ([f"train.sample_max_new_tokens={10**8}"], "less than or equal to 1000000"),
        (["--max-restarts", str(10**20)], "give 0 to 1000"),
        (["train.micro_batch='8'"], "quoted text"),
        (["train.max_steps=\"100\""], "quoted text"),
        # names that are paths: runs/<name> would leave runs/
        (["name=../../etc"], "is not a run name"),
        (["name=a/b"], "is not a run name"),
        (["name=-rf"], "is not a run name"),
        (["--recipe-file", str(recipe_newline)], "is not a run name"),
        (["--output-dir", f"{root}/a\nb"], "line break"),  # the last --output-dir counts
        # model states alone (the planner's exact count) past this machine's memory: 405B on CPU ranks
        (["model.name=llama-3.1-405b"], "of host memory"),
        # config.json that builds nonsense or disagrees with its weights
        ([f"model.name={_folder(root, 'nolayers', {**_CFG, 'num_hidden_layers': 0})}"], "num_hidden_layers is 0"),
        ([f"model.name={_folder(root, 'maxpos0', {**_CFG, 'max_position_embeddings': 0})}"],
         "max_position_embeddings is 0"),
        ([f"model.name={_folder(root, 'heads', {**_CFG, 'num_key_value_heads': 3})}"], "not a multiple"),
        ([f"model.name={_nan_folder(root)}"], "rms_norm_eps is not a finite number"),
        ([auto, f"model.name={_saved(root, 'fewer', {'num_hidden_layers': 1})}"], "does not build"),
        ([auto, f"model.name={_saved(root, 'index', files={'model.safetensors.index.json': index})}"],
         "model-00002-of-00002.safetensors, which is not in the folder"),
    ]


@pytest.mark.timeout(300)
def test_bad_inputs_one_line_exit_2_folder_unchanged(tmp_path, monkeypatch, capsys):
    from shardtune import cli
    from shardtune.train.launcher import supervise as commands

    def no_torchrun(*a, **k):
        raise AssertionError("torchrun was started for bad input")

    monkeypatch.setattr(commands, "run_process_group", no_torchrun)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "keep.txt").write_text("user file")
    before = sorted((p.relative_to(run_dir), p.read_bytes()) for p in run_dir.rglob("*") if p.is_file())
    failures = []
    cases = _cases(tmp_path)
    capsys.readouterr()
    for args, needle in cases:
        recipe = str(RECIPE)
        if args[:1] == ["--recipe-file"]:
            recipe, args = args[1], []
        rc = cli.main(["train", recipe, "--nproc", "2", "--output-dir", str(run_dir), *args])
        err = capsys.readouterr().err.strip().splitlines()
        if rc != 2 or len(err) != 1 or needle not in err[0]:
            failures.append((args, rc, err))
    after = sorted((p.relative_to(run_dir), p.read_bytes()) for p in run_dir.rglob("*") if p.is_file())
    assert not failures, failures
    assert after == before


@pytest.mark.timeout(120)
def test_a_rank_side_user_error_is_one_line_exit_2_without_torchrun_block(tmp_path):
    """What only a rank can see reaches the user through torchrun's error file (train/launcher/agent.py), once."""
    import os
    import sys

    from shardtune.processes import run_bounded

    log = tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "shardtune.train.launcher.agent", str(log), "--", "--standalone", "--nproc-per-node=2",
           "-m", "shardtune.train", str(RECIPE), "train.max_steps=true"]
    proc = run_bounded(cmd, timeout_s=100, cwd=REPO, env={**os.environ, "SHARDTUNE_PREFLIGHT": "done"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "max_steps = true is a boolean" in lines[0], proc.stderr
    assert "ChildFailedError" in log.read_text()  # torchrun's block is kept, in the log


def test_export_to_a_file_is_one_line_exit_2_and_the_file_is_kept(tmp_path, capsys):
    from shardtune import cli

    target = tmp_path / "model.bin"
    target.write_bytes(b"user data")
    rc = cli.main(["export", str(tmp_path / "no-checkpoint"), str(target)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "is a file" in err[0], err
    assert target.read_bytes() == b"user data"


def _one_line(capsys, argv: list[str]) -> tuple[int, list[str]]:
    from shardtune import cli

    rc = cli.main(argv)
    return rc, capsys.readouterr().err.strip().splitlines()


# checked before anything is read or started: a missing TARGET / checkpoint shows the check's order
LAUNCH_CASES = [
    (["--checkpoint-grace-s", "0"], "--checkpoint-grace-s 0"),
    (["--checkpoint-grace-s", "70000"], "1..65535"),
    (["--gpus-per-node", "1000000"], "1 to 1024"),
    (["--nodes", "100000000"], "1 to 100,000"),
    (["--max-restarts", str(10**20)], "give 0 to 1000"),
    (["--venv", "/opt/venv\nrm -rf ~"], "line break"),
    (["name=../../etc"], "is not a run name"),
    (['output_dir="/ckpt\\nx"'], "line break"),  # YAML's escape: a real line break
]


@pytest.mark.parametrize("kind", ["torchrun", "slurm", "k8s"])
def test_launch_bad_values_one_line_exit_2_no_script(tmp_path, capsys, kind):
    """Every launcher refuses the same values before a script is written (-o stays absent)."""
    out = tmp_path / "job.sh"
    failures = []
    for args, needle in LAUNCH_CASES:
        if kind == "k8s" and args[0] == "--venv":  # its image holds the environment
            continue
        extra = ["--rdzv-host", "node0"] if kind == "torchrun" else []
        rc, err = _one_line(capsys, ["launch", kind, str(RECIPE), "-o", str(out), *extra, *args])
        if rc != 2 or len(err) != 1 or needle not in err[0]:
            failures.append((args, rc, err))
    assert not failures and not out.exists(), failures


@pytest.mark.parametrize("args, needle", [
    (["slurm", "--cpus-per-task", "0"], "--cpus-per-task 0"),
    (["slurm", "--time", "99999999999999"], "beyond what Slurm can hold"),
    (["k8s", "--checkpoint-mount", "/ckpt/../etc"], "'..'"),
    (["k8s", "--elastic", "1:99999999999"], "MAX <= 100,000"),  # the layout check looped over every count
])
def test_launcher_specific_bad_values(capsys, args, needle):
    rc, err = _one_line(capsys, ["launch", args[0], str(RECIPE), *args[1:]])
    assert rc == 2 and len(err) == 1 and needle in err[0], err


@pytest.mark.parametrize("argv, needle", [
    (["generate", "NOPE", "--prompt", "x", "--temperature", "nan"], "--temperature nan"),
    (["generate", "NOPE", "--prompt", "x", "--temperature", "inf"], "--temperature inf"),
    (["generate", "NOPE", "--prompt", "x", "--top-p", "nan"], "--top-p nan"),
    (["generate", "NOPE", "--prompt", "x", "--seed", str(2**64)], "--seed"),
    (["generate", "NOPE", "--prompt", "x", "--max-new-tokens", str(10**12)], "--max-new-tokens"),
    (["export", "NOPE", "OUT", "--dtype", "int8"], "--dtype 'int8'"),
    (["export", "NOPE", "OUT\nx"], "line break"),
    (["export", "NOPE", "OUT", "--max-shard-size", "."], "not understood"),
    (["export", "NOPE", "OUT", "--max-shard-size", "1.2.3GB"], "not understood"),
    (["export", "NOPE", "OUT", "--max-shard-size", "9" * 400 + "GB"], "beyond any file"),
    (["bench", "comm", "--timeout", "nan"], "finite"),
    (["bench", "comm", "--nproc", "100000"], "at most 1024"),
    (["bench", "comm", "--sizes", "infG"], "above 64 GiB"),
    (["bench", "comm", "--sizes", "nanK"], "at least 1 byte"),
    (["bench", "comm", "--sizes", "100000G"], "above 64 GiB"),
    (["doctor", "--rdzv", "node0\n:29500"], "is not HOST:PORT"),
    (["doctor", "--rdzv", "node0:\u00b2"], "is not HOST:PORT"),
])
def test_option_checks_come_first_one_line_exit_2(tmp_path, monkeypatch, capsys, argv, needle):
    """Options are refused before the TARGET / checkpoint is read or a rank starts (bench would start ranks)."""
    import subprocess

    def no_process(*a, **k):
        raise AssertionError(f"a process was started: {a[:1]}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.chdir(tmp_path)
    rc, err = _one_line(capsys, argv)
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "OUT").exists()


def test_bench_nccl_without_cuda_is_refused_before_ranks_start(monkeypatch, capsys):
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl is a valid backend here")
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    rc, err = _one_line(capsys, ["bench", "comm", "--backend", "nccl"])
    assert rc == 2 and len(err) == 1 and "needs CUDA" in err[0], err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("edit, files, needle", [
    ({"num_hidden_layers": 3}, None, "lacks model.layers.2"),
    ({"model_type": "bert"}, None, "lacks"),
    ({"max_position_embeddings": 0}, None, "max_position_embeddings is 0"),
    ({"chat_template": "{% for %}"}, {"tokenizer_config.json": b"{}"}, "chat template cannot render"),
])
def test_generate_from_a_folder_that_disagrees_is_one_line(tmp_path, capsys, edit, files, needle):
    """transformers would answer from randomly filled weights (with a warning): one line instead, and
    no "generating with" line before it."""
    from shardtune.train.data.tokenizer import ByteTokenizer

    folder = _saved(tmp_path, "model", None if "chat_template" in edit else edit, files)
    ByteTokenizer().save_pretrained(folder)
    if "chat_template" in edit:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, **edit}))
        (folder / "chat_template.jinja").unlink(missing_ok=True)
    capsys.readouterr()
    rc, err = _one_line(capsys, ["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "2"])
    assert rc == 2 and len(err) == 1 and needle in err[0], err


def _fifo(d: Path) -> Path:
    import os

    os.mkfifo(d / "pipe")
    return d / "pipe"


def _loop(d: Path) -> Path:
    (d / "a").symlink_to(d / "b")
    (d / "b").symlink_to(d / "a")
    return d / "a"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make, argv, needle", [
    (_fifo, ["launch", "slurm", str(RECIPE), "-o", "{}"], "named pipe nobody reads"),  # the write would block
    (_fifo, ["bench", "comm", "-o", "{}"], "named pipe nobody reads"),  # ... after the whole measurement
    (_loop, ["bench", "comm", "-o", "{}"], "link to nothing"),
    (_loop, ["export", "NOPE", "{}"], "link to nothing"),
    (lambda d: d / ("x" * 300), ["train", str(RECIPE), "--output-dir", "{}"], "File name too long"),
    (lambda d: d / ("x" * 300), ["generate", "{}", "--prompt", "x"], "File name too long"),
    (lambda d: d / ("x" * 300), ["export", "{}", "out"], "File name too long"),
    (lambda d: "~nosuchuser-st/x", ["generate", "{}", "--prompt", "x"], "~USER"),
    (lambda d: "~nosuchuser-st/x", ["bench", "comm", "-o", "{}"], "~USER"),
])
def test_odd_paths_are_one_line_exit_2(tmp_path, monkeypatch, capsys, make, argv, needle):
    import subprocess

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    monkeypatch.chdir(tmp_path)
    path = str(make(tmp_path))
    rc, err = _one_line(capsys, [a.replace("{}", path) for a in argv])
    assert rc == 2 and len(err) == 1 and needle in err[0], err


@pytest.mark.timeout(120)
def test_library_import_notices_do_not_precede_the_line_in_a_fresh_process(tmp_path):
    """torchao logs "Failed to load <CUDA .so>" and torch's pytree an Enum deprecation when
    transformers first imports them (4 lines here before the fix): in a fresh process, as a user runs
    it, stderr is still the one line. In-process tests cannot see this (modules import once)."""
    import sys

    from shardtune.processes import run_bounded
    from shardtune.train.data.tokenizer import ByteTokenizer

    folder = _saved(tmp_path, "model", {"num_hidden_layers": 3})
    ByteTokenizer().save_pretrained(folder)
    cmd = [sys.executable, "-m", "shardtune.cli", "generate", str(folder), "--prompt", "hi"]
    proc = run_bounded(cmd, timeout_s=100, cwd=REPO)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "lacks model.layers.2" in lines[0], proc.stderr[-2000:]
