"""What a trained model answers, in one process (`shardtune generate`, train/generate_commands.py).

TARGET is an exported Hugging Face folder, a run folder (its `hf_export` when that is newer than
its last checkpoint, else the newest checkpoint that verifies) or a `checkpoints/step_<N>` folder.
A checkpoint is read through the project's safe reader (train/durable/safe_load.py: no pickle
beyond the allow-list), its checksums checked first, onto the model of its own hf/config.json
(the run's model); a LoRA checkpoint is merged through a temporary export. The prompt goes
through the tokenizer's chat template (plain text when it has none); the answer is transformers'
`generate` (greedy unless --temperature > 0; only the options given here, not the folder's
generation settings), stopping at the tokenizer's eos and generation_config.json's eos ids.
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.utils import logging as hf_logging

from shardtune.errors import UserError, read_json_object
from shardtune.train.core.lora import CONFIG_KEY
from shardtune.train.durable.ckpt_files import META_FILE, complete_checkpoints, read_info, why_not_checkpoint
from shardtune.train.durable.export import export_checkpoint, hf_name, model_tensors
from shardtune.train.durable.export_files import verify_weights
from shardtune.train.durable.safe_load import SafeFileSystemReader, safe_dcp_load
from shardtune.train.durable.shards import damage
from shardtune.train.launcher.preflight import check_hf_config

_ACCEPTS = "give an exported Hugging Face folder, a run folder or a checkpoints/step_<N> folder"
PICKLE_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


def _hf_folder(folder: Path) -> bool:
    """A model folder transformers can load without pickle: config.json and safetensors."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _written_at(export: Path) -> float:
    """When an export was written: its weights' newest mtime (config and tokenizer keep the source's)."""
    return max(p.stat().st_mtime for p in export.glob("*.safetensors"))


def _verified(info) -> list[str]:
    """Checksums, then the shards against `.metadata` (shards.py)."""
    return damage(info)


def resolve_target(target: str) -> tuple[str, Path]:
    """("hf", folder) or ("checkpoint", step folder) for TARGET; one line (UserError) otherwise."""
    path = Path(target).expanduser()
    if not path.is_dir():
        raise UserError(f"TARGET {target!r} is not a folder; {_ACCEPTS}")
    if (path / META_FILE).is_file():
        info = read_info(path)
        if info is None:
            raise UserError(f"TARGET {target!r} is not a complete shardtune checkpoint ({why_not_checkpoint(path)}); "
                            f"{_ACCEPTS}")
        bad = _verified(info)
        if bad:
            more = f" (and {len(bad) - 1} more)" if bad[1:] else ""
            raise UserError(f"checkpoint {target} is damaged: {bad[0]}{more}")
        return "checkpoint", path
    if (path / "config.json").is_file():
        if _hf_folder(path):
            return "hf", path
        pickled = sorted(p.name for pat in PICKLE_WEIGHTS for p in path.glob(pat))
        why = f"has pickle weights only ({', '.join(pickled[:2])}; a pickle can run code)" if pickled else \
            "has no *.safetensors weights"
        raise UserError(f"TARGET {target!r} {why}; {_ACCEPTS}")
    found = complete_checkpoints(path)
    export = path / "hf_export"
    if _hf_folder(export) and (not found or _written_at(export) >= found[-1].saved_at):
        return "hf", export
    for info in reversed(found):
        bad = _verified(info)
        if not bad:
            return "checkpoint", info.path
        print(f"shardtune: skipping {info.path.name}: {bad[0]}", file=sys.stderr, flush=True)
    if found:
        raise UserError(f"run folder {target!r}: no checkpoint verifies (all damaged); {_ACCEPTS}")
    raise UserError(f"TARGET {target!r} holds no model (no config.json, hf_export or complete checkpoint); {_ACCEPTS}")


def _load_checkpoint_model(ckpt: Path, device):
    """The checkpoint's model weights onto its hf/config.json model, in fp32, one process."""
    hf = ckpt / "hf"
    if json.loads((hf / "config.json").read_text()).get(CONFIG_KEY):  # LoRA: merged by the export
        with tempfile.TemporaryDirectory(prefix="shardtune-generate-") as tmp:
            return _load_hf_folder(export_checkpoint(ckpt, Path(tmp) / "model", dtype="fp32"), device)
    reader = SafeFileSystemReader(ckpt)
    entries = model_tensors(ckpt)  # reads .metadata through the allow-list
    want = {k: torch.empty(shape, dtype=dt) for k, _, shape, dt in entries}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        safe_dcp_load(want, reader, no_dist=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf, local_files_only=True),
                                             dtype=torch.float32)
    result = model.load_state_dict({hf_name(k): want[k] for k, *_ in entries}, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) - tied:
        names = (result.unexpected_keys or sorted(set(result.missing_keys) - tied))[:2]
        raise UserError(f"checkpoint {ckpt} does not match its hf/config.json model ({', '.join(names)}); "
                        "was it written by shardtune train?")
    model.tie_weights()
    return model.to(device)


def _check_config(folder: Path) -> None:
    """config.json as the trainer's launcher checks a model folder's (finite, positive sizes)."""
    path = folder / "config.json"
    check_hf_config(str(folder), read_json_object(path, "config.json", "give the folder's own config.json"))


def _check_loaded(folder: Path, model, info: dict) -> None:
    """transformers fills weights the files lack with random values, with a warning: here that is an
    answer from garbage, so missing, unexpected or mis-shaped tensors are one line instead."""
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(info.get("missing_keys") or ()) - tied)
    unexpected = sorted(k for k in info.get("unexpected_keys") or () if not k.endswith("inv_freq"))
    shapes = [m[0] if isinstance(m, tuple) else m for m in info.get("mismatched_keys") or ()]
    for what, names in (("lacks", missing), ("holds tensors its config.json does not build, e.g.", unexpected),
                        ("has tensors of another shape than its config.json builds, e.g.", shapes)):
        if names:
            raise UserError(f"the model in {folder} {what} {names[0]}"
                            f"{f' (and {len(names) - 1} more)' if names[1:] else ''}; give the folder's "
                            "matching config.json and weights")


def _load_hf_folder(folder: Path, device):
    """An HF folder's model in fp32, every tensor it builds read from the files (`_check_loaded`)."""
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, use_safetensors=True,
                                                           local_files_only=True, output_loading_info=True)
    except Exception as e:
        raise UserError(f"cannot load the model in {folder}: {' '.join(str(e).split())[:160]}") from None
    _check_loaded(folder, model, info)
    return model.to(device)


def load_for_generation(kind: str, folder: Path, trust_unverified: bool = False):
    """(model in eval mode, tokenizer, stop ids) for a resolved TARGET."""
    hf_logging.disable_progress_bar()  # stderr stays for errors; stdout holds only the answer
    hf_logging.set_verbosity_error()  # its load report (missing / unexpected tensors) is _check_loaded's one line
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok_dir = folder / "hf" if kind == "checkpoint" else folder
    _check_config(tok_dir)
    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    except Exception as e:
        raise UserError(f"cannot load the tokenizer in {tok_dir}: {' '.join(str(e).split())[:160]}") from None
    if kind == "checkpoint":
        model = _load_checkpoint_model(folder, device)
    else:
        verify_weights(folder, trust_unverified)  # an export's weights as it wrote them (their SHA-256)
        model = _load_hf_folder(folder, device)
    stops = {tok.eos_token_id} - {None}
    if (tok_dir / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(str(tok_dir), local_files_only=True).eos_token_id
        stops |= set(eos if isinstance(eos, list) else [eos]) - {None}
    return model.eval(), tok, sorted(stops)


def check_text(prompt: str, system: str | None) -> None:
    """Bytes that are not UTF-8 reach argv as surrogates (os.fsdecode): one line naming the option,
    before anything loads (not a tokenizer's or chat template's error)."""
    for option, text in (("--prompt", prompt), ("--system", system or "")):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UserError(f"{option} is not text: byte {ord(text[e.start]) & 0xFF:#04x} at character {e.start} "
                            "is not UTF-8 (binary data?); give the prompt as text") from None


def prompt_ids(tok, prompt: str, system: str | None) -> list[int]:
    """The chat template with a generation prompt; plain text (system, blank line, prompt) without one."""
    if tok.chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        try:
            return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False))
        except Exception as e:  # a template that refuses a system turn, or a broken one: jinja's own words
            hint = "; try without --system" if system else ""
            raise UserError(f"the tokenizer's chat template cannot render this prompt ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:160]}){hint}") from None
    return list(tok((f"{system}\n\n" if system else "") + prompt)["input_ids"])


MAX_NEW_TOKENS = 1_000_000  # beyond any model's positions; a typo's extra digits stop here


def check_options(max_new_tokens: int, temperature: float, top_p: float, seed: int) -> None:
    """The options before any folder is read: finite, in range."""
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"--max-new-tokens {max_new_tokens}: give 1 to {MAX_NEW_TOKENS:,}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise UserError(f"--temperature {temperature}: give a finite number >= 0 (0: greedy)")
    if not 0 < top_p <= 1:  # NaN fails this too
        raise UserError(f"--top-p {top_p}: give a number in (0, 1]")
    if not 0 <= seed < 2**63:
        raise UserError(f"--seed {seed}: give 0 to 2^63 - 1")


def generate_answer(target: str, prompt: str, *, max_new_tokens: int = 256, temperature: float = 0.0,
                    top_p: float = 1.0, system: str | None = None, seed: int = 0,
                    trust_unverified: bool = False) -> str:
    """TARGET's answer to `prompt` (the decoded new tokens, special tokens dropped)."""
    check_options(max_new_tokens, temperature, top_p, seed)
    check_text(prompt, system)
    kind, folder = resolve_target(target)
    model, tok, stops = load_for_generation(kind, folder, trust_unverified)
    ids = torch.tensor([prompt_ids(tok, prompt, system)], device=model.device)
    # said once the folder loaded and the prompt rendered: a failure is the error's one line alone
    print(f"shardtune: generating with the {'checkpoint' if kind == 'checkpoint' else 'model'} in {folder}",
          file=sys.stderr, flush=True)
    sample = temperature > 0
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, eos_token_id=stops,
                           pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stops[0],
                           **({"temperature": temperature, "top_p": top_p, "top_k": 0} if sample else {}))
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
