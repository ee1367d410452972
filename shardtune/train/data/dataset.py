"""Instruction data → packed, sharded micro-batches with a resumable position.

Micro-batch contract (what `train/core/step.py` consumes), each a (B, T) torch.long tensor,
B = train.micro_batch, T = train.seq_len:
  input_ids     token ids; padding is `tokenizer.pad_id`.
  labels        ALREADY SHIFTED: labels[b, t] is the next token of the same example, or -100 (no
                loss: prompt / user turns, padding, every example's last token). Loss = sum of
                token cross-entropies / labels != -100 over the step's micro-batches and ranks. Do
                NOT pass them to an HF model as `labels=` (shifted twice); `shift_labels=` takes them.
  position_ids  0, 1, 2, ... restarting at every example (and for the padding tail).
Call the model with `attention_mask=None` and these position_ids: transformers builds a
block-diagonal causal mask from the restarts. Every micro-batch takes the next B·D rows of one
seeded row stream (D = data-parallel size), the same at any world size (docs/checkpoints.md,
"Data position"). `check_dataset` imports no torch, so the CLI can run it before any process.
Packing, `build_row` (this contract) and the loader: packing.py; several sources: mix.py; the
tokenised cache: cache.py. This module reads, tokenizes and builds through them.
"""
from __future__ import annotations

from pathlib import Path

from shardtune.errors import UserError
from shardtune.train.data.packing import PackedData, PackedLoader, pack_examples
from shardtune.train.data.sources import GENERATED, read_records, source_configs  # noqa: F401 (GENERATED re-exported)
from shardtune.train.data.tokenizer import load_tokenizer


def check_dataset(data_cfg) -> int:
    """Validate the dataset, or each of data.sources (no torch, no tokenizer); returns the examples."""
    return sum(len(read_records(cfg)) for cfg, _ in source_configs(data_cfg))


# ---------------------------------------------------------------- tokenization
def build_tokenizer(data_cfg, model_name: str, trust_remote_code: bool = False):
    """The model folder's tokenizer (`data.tokenizer` auto/hf, local files only) or the byte one.

    Refuses a tokenizer whose ids do not fit the model's embedding (vocab_size of its config).
    """
    from shardtune.catalog.models import resolve_model_config

    tok = load_tokenizer(data_cfg.tokenizer, model_name, trust_remote_code)
    if data_cfg.chat_template:
        _override_template(tok, data_cfg.chat_template)
    model_vocab = resolve_model_config(model_name).get("vocab_size")
    if model_vocab is not None and tok.vocab_size > model_vocab:
        raise UserError(f"the {tok.name} tokenizer has {tok.vocab_size} ids but model {model_name!r} has vocab_size "
                        f"{model_vocab}; use the model's own tokenizer (data.tokenizer=auto) or a model with a "
                        "larger vocabulary")
    return tok


def _override_template(tok, spec: str) -> None:
    """data.chat_template: a named template (catalog/chat_templates.py), a Jinja template, or a
    .jinja file holding one, replaces the tokenizer's."""
    from shardtune.catalog.chat_templates import CHAT_TEMPLATES, is_template_name, unknown_template_message

    path = Path(spec).expanduser()
    if is_template_name(spec):
        if spec not in CHAT_TEMPLATES:  # the config refuses it first; a DataConfig built by hand too
            raise UserError(unknown_template_message(spec))
        spec = CHAT_TEMPLATES[spec].jinja
    elif spec.endswith((".jinja", ".j2")):
        if not path.is_file():
            raise UserError(f"data.chat_template file {spec!r} does not exist; give a .jinja file or the template")
        spec = path.read_text(encoding="utf-8")
    if tok.name == "byte":
        raise UserError("data.chat_template needs the model folder's tokenizer (data.tokenizer=auto/hf with a model "
                        "folder); the byte tokenizer uses the plain template")
    tok.tok.chat_template = spec
    tok.chat_template = spec


def encode_example(record: dict, tokenizer, template: str = "auto", train_on_inputs: bool = False,
                   system_prompt: str | None = None) -> tuple[list[int], list[bool]]:
    """(ids, is_target) of one example: is_target[i] says token i is predicted (gets a loss).

    text: bos + text + eos, every token after the first is a target.
    prompt_response: the tokenizer's chat template over [user: prompt, assistant: response] when
    template is chat (or auto and the tokenizer has one); else plain: bos + prompt + response +
    eos with the response and eos as targets (the prompt carries its own separator).
    chat: the chat template, or the plain chat template (tokenizer.py); assistant turns are targets.
    system_prompt: a system turn put first in prompt_response and chat examples that have none.
    train_on_inputs: every token after the first is a target (prompts and user turns too).
    """
    if system_prompt and "text" not in record:
        msgs = record.get("messages") or [{"role": "user", "content": record["prompt"]},
                                          {"role": "assistant", "content": record["response"]}]
        if msgs[0]["role"] != "system":
            record = {"messages": [{"role": "system", "content": system_prompt}, *msgs]}
    ids, mask = _encode(record, tokenizer, template)
    if train_on_inputs:
        mask = [False] + [True] * (len(ids) - 1)
    return ids, mask


def _encode(record: dict, tokenizer, template: str) -> tuple[list[int], list[bool]]:
    use_chat = template == "chat" or (template == "auto" and tokenizer.chat_template)
    if template == "chat" and not tokenizer.chat_template:
        raise UserError("data.template=chat but the tokenizer has no chat template; set data.template=auto or plain")
    if "text" in record:
        ids = tokenizer.bos_prefix() + tokenizer.encode(record["text"]) + [tokenizer.eos_id]
        return ids, [False] + [True] * (len(ids) - 1)
    if "prompt" in record and not use_chat:
        segs = [(tokenizer.bos_prefix() + tokenizer.encode(record["prompt"]), False),
                (tokenizer.encode(record["response"]) + [tokenizer.eos_id], True)]
    else:
        msgs = record.get("messages") or [{"role": "user", "content": record["prompt"]},
                                          {"role": "assistant", "content": record["response"]}]
        segs = tokenizer.render_chat(msgs) if use_chat else _plain_chat(tokenizer, msgs)
    ids = [i for seg, _ in segs for i in seg]
    mask = [t for seg, t in segs for _ in seg]
    return ids, mask


def _plain_chat(tokenizer, msgs):
    from shardtune.train.data.tokenizer import render_plain_chat

    return render_plain_chat(tokenizer, msgs)



def encode_records(records: list[dict], tokenizer, data_cfg, what: str = "example"):
    """`encode_example` over the records with data_cfg's template, train_on_inputs and system
    prompt; a template that raises is one line naming the example."""
    encoded = []
    opts = {"train_on_inputs": data_cfg.train_on_inputs, "system_prompt": data_cfg.system_prompt}
    for k, record in enumerate(records, 1):
        try:
            encoded.append(encode_example(record, tokenizer, data_cfg.template, **opts))
        except UserError:
            raise
        except Exception as e:  # e.g. a chat template that raises on this conversation (jinja)
            raise UserError(f"{what} {k} (the {k}-th non-empty line) cannot be tokenized: "
                            f"{' '.join(str(e).split())[:200]}; fix it or set data.template=plain") from None
    return encoded


def build_dataset(data_cfg, seq_len: int, tokenizer, seed: int) -> PackedData:
    """Read, tokenize and pack the whole dataset (every rank does the same, deterministically)."""
    def build() -> PackedData:
        return pack_examples(encode_records(read_records(data_cfg), tokenizer, data_cfg), seq_len, data_cfg.packing,
                             seed, data_cfg.shuffle)

    cache_dir = resolve_cache_dir(data_cfg.cache_dir)
    if cache_dir is None:
        return build()
    from shardtune.train.data.cache import cache_inputs, cached_packed, key_of  # pyarrow: optional (shardtune[data])

    inputs = cache_inputs(data_cfg, seq_len, tokenizer, seed)
    return cached_packed(cache_dir, key_of(inputs), build, inputs, tokenizer.vocab_size)


def resolve_cache_dir(spec: str | None) -> str | None:
    """data.cache_dir → the folder of the tokenised cache, None for in memory. `auto`: the user's
    cache folder ($XDG_CACHE_HOME/shardtune/data, else ~/.cache/shardtune/data), as Hugging Face
    datasets keeps ~/.cache/huggingface/datasets; in memory without pyarrow (shardtune[data]) or
    when that folder cannot be written (said once per process)."""
    import importlib.util
    import os
    import sys

    if spec != "auto":
        return spec or None
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardtune" / "data"
    if importlib.util.find_spec("pyarrow") is None:
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
        writable = os.access(root, os.W_OK | os.X_OK)
    except OSError:
        writable = False
    if not writable:
        # said once: by the launcher (not again by its ranks), or by rank 0 of a by-hand torchrun
        said = os.environ.get("SHARDTUNE_PREFLIGHT") == "done" or int(os.environ.get("RANK", "0") or 0) != 0
        if root not in _NOTED and not said:
            _NOTED.add(root)
            print(f"shardtune: data cache {str(root)!r} is not writable; tokenising in memory (set data.cache_dir "
                  "to a writable folder)", file=sys.stderr, flush=True)
        return None
    return str(root)


_NOTED: set[Path] = set()


def cached_rows(data_cfg, seq_len: int, tokenizer, seed: int) -> int | None:
    """The rows of this data's whole tokenised cache if one is there (no building, no torch), else None."""
    cache_dir = resolve_cache_dir(data_cfg.cache_dir)
    if cache_dir is None:
        return None
    from shardtune.train.data.cache import cache_inputs, check_cache, key_of, load_cache  # pyarrow: optional

    inputs = cache_inputs(data_cfg, seq_len, tokenizer, seed)
    folder = Path(cache_dir) / key_of(inputs)
    ok = folder.is_dir() and check_cache(folder, inputs, tokenizer.vocab_size) is None
    return load_cache(folder).num_rows if ok else None


def build_dataloader(data_cfg, train_cfg, tokenizer, dp_rank: int, dp_size: int, seed: int) -> PackedLoader:
    """This data-parallel rank's loader (see the module docstring for the order guarantee)."""
    if data_cfg.sources:
        from shardtune.train.data.mix import build_mixed_loader  # imports torch; the launcher imports this module

        sources = [(build_dataset(cfg_k, train_cfg.seq_len, tokenizer, seed + k), weight)
                   for k, (cfg_k, weight) in enumerate(source_configs(data_cfg))]
        loader = build_mixed_loader(sources, train_cfg.micro_batch, dp_rank, dp_size, seed, data_cfg.shuffle,
                                    tokenizer.pad_id)
        _check_fills(loader.num_rows, train_cfg, dp_size)
        return loader
    data = build_dataset(data_cfg, train_cfg.seq_len, tokenizer, seed)
    _check_fills(data.num_rows, train_cfg, dp_size)
    return PackedLoader(data, train_cfg.micro_batch, dp_rank, dp_size, seed, data_cfg.shuffle, tokenizer.pad_id)


def _check_fills(num_rows: int, train_cfg, dp_size: int) -> None:
    rows_per_step = train_cfg.micro_batch * train_cfg.grad_accum * dp_size
    if num_rows < rows_per_step:  # else one step would hold the same row twice
        raise UserError(f"the dataset fills {num_rows} rows of seq_len {train_cfg.seq_len}, fewer than one "
                        f"global batch ({rows_per_step} = micro_batch × grad_accum × {dp_size} ranks); add data or "
                        "lower train.micro_batch / grad_accum")


def steps_for_epochs(num_rows: int, epochs: float, rows_per_step: int) -> int:
    """Optimizer steps that cover `epochs` passes over `num_rows` rows (rounded up, at least 1).

    rows_per_step = micro_batch × grad_accum × data-parallel size.
    """
    import math

    return max(1, math.ceil(epochs * num_rows / rows_per_step))
