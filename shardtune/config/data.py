"""`data:` — the dataset, its format, tokenizer, template and packing."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from shardtune.config.base import _Section


class DataConfig(_Section):
    path: str | None = Field(
        None, description="The training data: a JSONL file (errors name file:line), a parquet / CSV / TSV / JSON / "
                          ".arrow file or a glob of them, a datasets save_to_disk folder, or a dataset id already "
                          "in the local Hugging Face cache (read offline). Rows: see `format`. None or "
                          "'generated': the built-in generated dataset (shardtune/train/data/datagen.py).")
    val_path: str | None = Field(None, description="Validation data (same sources and formats as `path`); its "
                                                    "loss is the global token mean over every rank.")
    split: str = Field("train", description="The split to read from a save_to_disk DatasetDict or a cached "
                                            "dataset id.")
    format: Literal["auto", "text", "prompt_response", "chat", "alpaca", "sharegpt"] = Field(
        "auto", description="auto: each row's keys decide (messages → chat, conversations → sharegpt, "
                            "instruction+output → alpaca, prompt+response/completion → prompt_response, "
                            "text → text); otherwise every row must have that format.")
    columns: dict[str, str] | None = Field(
        None, description="Our field ← the dataset's column, applied before `format`, e.g. {prompt: question, "
                          "response: answer} or {text: body}. A column the dataset lacks is refused.")
    train_on_inputs: bool = Field(False, description="Loss on every token (prompts and user turns too), not only "
                                                     "on responses / assistant turns.")
    system_prompt: str | None = Field(None, description="A system turn put first in prompt_response and chat "
                                                        "examples that have none.")
    tokenizer: Literal["auto", "byte", "hf"] = Field(
        "auto", description="auto: the model folder's tokenizer if it has one, else the built-in byte-level "
                            "tokenizer; byte: always bytes; hf: the folder's tokenizer or an error.")
    template: Literal["auto", "chat", "plain"] = Field(
        "auto", description="How prompt/response and chat examples become text. auto: the tokenizer's chat "
                            "template if it has one, else plain; plain: bos+prompt+response+eos, chat turns "
                            "as '<|role|>\\n' + content.")
    packing: bool = Field(
        True, description="Pack several examples into each seq_len row (position ids restart per example; no "
                          "attention across examples, see train/data/dataset.py). False: one example per row, "
                          "padded.")
    shuffle: bool = Field(True, description="Shuffle the rows each epoch (seeded by train.seed).")
    generated_examples: int = Field(4000, ge=1, description="Size of the built-in generated dataset.")
    generated_seed: int = Field(1234, description="Seed of the built-in generated dataset (independent of "
                                                  "train.seed, so runs with different seeds see the same data).")
