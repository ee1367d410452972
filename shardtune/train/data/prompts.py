"""Prompts for online RL (`train.objective: grpo`, docs/rl.md): rows with a `prompt` column (a string
or a list of chat messages) and any other columns, which the reward functions receive.

A prompt is rendered as an SFT example with an empty response (dataset.encode_example: the chat
template's assistant header, or bos + prompt) and cut before its first target token: what the
model sees before it answers (the same rule as train.sample_prompts). `PromptLoader` deals the
prompts as PackedLoader deals rows: micro-batch k of a step takes global stream slots
position + dp_rank·micro_batch …, so a prompt's slot (which seeds its completions) is the same at
every world size for the same global batch.
"""
from __future__ import annotations

from shardtune.errors import UserError
from shardtune.train.data.dataset import encode_example
from shardtune.train.data.packing import StreamOrder
from shardtune.train.data.sources import ROLES, read_records


def normalize_prompt(obj, where: str, want: str = "auto", columns: dict[str, str] | None = None) -> dict:
    """One row → {"prompt": str | [messages], "columns": {the row's other columns}}."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected an object with a 'prompt' column, got {type(obj).__name__}")
    if columns:
        obj = {**obj, **{ours: obj[theirs] for ours, theirs in columns.items()}}
    prompt = obj.get("prompt")
    if prompt is None:
        raise UserError(f"{where}: train.objective=grpo needs a 'prompt' column but the row has columns "
                        f"{sorted(obj)[:8]}; give prompts or map a column with data.columns "
                        "(e.g. {prompt: question})")
    if not isinstance(prompt, str) and not (isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in prompt)):
        raise UserError(f"{where}: 'prompt' must be a string or a non-empty list of {{role, content}} messages "
                        f"(roles {', '.join(ROLES)})")
    return {"prompt": prompt, "columns": {k: v for k, v in obj.items() if k != "prompt"}}


def prompt_text(prompt) -> str:
    """The prompt as the reward functions get it: the string, or the last user turn's content."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), prompt[-1]["content"])


def prompt_ids(prompt, tokenizer, data_cfg) -> list[int]:
    """The ids the model sees before its answer."""
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    ids, mask = encode_example({"messages": [*msgs, {"role": "assistant", "content": ""}]}, tokenizer,
                               data_cfg.template, system_prompt=data_cfg.system_prompt)
    return ids[:mask.index(True)] if True in mask else ids


class PromptData:
    """The prompts of one part (train or val): records, their ids, and the column names."""

    def __init__(self, data_cfg, tokenizer, part: str = "train", max_prompt_tokens: int | None = None):
        if part == "val" and data_cfg.val_path:
            data_cfg = data_cfg.model_copy(update={"path": data_cfg.val_path})
            part = "train"  # all of val_path's rows
        self.records = [r if "columns" in r else normalize_prompt(r, f"generated example {i + 1}")  # generated: as is
                        for i, r in enumerate(read_records(data_cfg, part, normalize_prompt))]
        self.ids = [prompt_ids(r["prompt"], tokenizer, data_cfg) for r in self.records]
        if max_prompt_tokens is not None:
            for i, ids in enumerate(self.ids):
                if len(ids) > max_prompt_tokens:
                    raise UserError(f"prompt {i + 1} of {data_cfg.path!r} ({part}) has {len(ids)} tokens, more than "
                                    f"train.seq_len {max_prompt_tokens} (a grpo run's longest prompt); shorten it or "
                                    "raise train.seq_len")

    def __len__(self) -> int:
        return len(self.records)


class PromptLoader(StreamOrder):
    """`next()` gives {"index": (micro_batch,) example ids, "slot": (micro_batch,) global stream slots}."""

    MISMATCH = ("the checkpoint's prompts were {saved}, this data has {now}; resume with the same data "
                "(or checkpoint.resume=never)")

    def __init__(self, data: PromptData, micro_batch: int, dp_rank: int, dp_size: int, seed: int, shuffle: bool):
        super().__init__(len(data), micro_batch, dp_rank, dp_size, seed, shuffle)
        self.data = data

    def __next__(self) -> dict:
        import torch

        slots = self.next_slots()
        return {"index": torch.tensor([self.index_at(g) for g in slots]), "slot": torch.tensor(slots)}


def check_prompt_data(cfg, dp_size: int) -> None:
    """The launcher's check: prompts read and rendered as the ranks will, enough for one step."""
    from shardtune.train.data.dataset import build_tokenizer

    tok = build_tokenizer(cfg.data, cfg.model.name, cfg.model.trust_remote_code)
    data = PromptData(cfg.data, tok, "train", cfg.train.seq_len)
    need = cfg.train.micro_batch * dp_size
    if len(data) < need:
        raise UserError(f"{len(data)} prompt(s) cannot fill one micro-batch of {cfg.train.micro_batch} on each of "
                        f"{dp_size} rank(s); give more prompts or lower train.micro_batch")
    if cfg.data.has_val:
        PromptData(cfg.data, tok, "val", cfg.train.seq_len)
