"""`data:` — the dataset, its format, tokenizer, template and packing."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from shardtune.catalog.chat_templates import CHAT_TEMPLATES, is_template_name, unknown_template_message
from shardtune.config.base import _Section

FORMAT = Literal["auto", "text", "prompt_response", "chat", "alpaca", "sharegpt"]


class SourceConfig(_Section):
    """One dataset of a mix (`data.sources`); template, packing and the other options are data's."""

    path: str = Field(description="Any source `data.path` takes (file, glob, folder, cached dataset id).")
    weight: float = Field(1.0, description="Sampling weight: the share of rows drawn from this source is "
                                           "weight / sum of weights. 0 leaves it out.")
    format: FORMAT = Field("auto", description="As data.format, for this source.")
    split: str = Field("train", description="As data.split, for this source.")
    columns: dict[str, str] | None = Field(None, description="As data.columns, for this source.")

    @model_validator(mode="after")
    def _weight(self):
        if self.weight < 0:
            raise ValueError(f"data.sources weight {self.weight} of {self.path!r} is negative; give a weight >= 0")
        return self


class DataConfig(_Section):
    path: str | None = Field(
        None, description="The training data: a JSONL file (errors name file:line), a parquet / CSV / TSV / JSON / "
                          ".arrow file or a glob of them, a datasets save_to_disk folder, or a dataset id already "
                          "in the local Hugging Face cache (read offline). Rows: see `format`. None or "
                          "'generated': the built-in generated dataset (shardtune/train/data/datagen.py).")
    val_path: str | None = Field(None, description="Validation data (same sources and formats as `path`); its "
                                                    "loss is the global token mean over every rank.")
    val_split: float | None = Field(
        None, gt=0, lt=1, description="Hold out this fraction of the training examples (e.g. 0.05) as the validation "
                                      "set instead of val_path: a seeded choice that depends on the data only (the "
                                      "same at every train.seed and world size); training never sees them.")
    split: str = Field("train", description="The split to read from a save_to_disk DatasetDict or a cached "
                                            "dataset id.")
    format: FORMAT = Field(
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
    chat_template: str | None = Field(
        None, description=f"Override the tokenizer's chat template: a named one ({', '.join(CHAT_TEMPLATES)}; "
                          "shardtune/catalog/chat_templates.py), a Jinja template, or a .jinja file holding one "
                          "(needs the model folder's tokenizer). Used where data.template is auto or chat.")
    packing: bool = Field(
        True, description="Pack several examples into each seq_len row (position ids restart per example; no "
                          "attention across examples, see train/data/dataset.py). False: one example per row, "
                          "padded.")
    shuffle: bool = Field(True, description="Shuffle the rows each epoch (seeded by train.seed).")
    generated_examples: int = Field(4000, ge=1, description="Size of the built-in generated dataset.")
    generated_seed: int = Field(1234, description="Seed of the built-in generated dataset (independent of "
                                                  "train.seed, so runs with different seeds see the same data).")
    cache_dir: str | None = Field(
        "auto", description="Tokenise once: the packed data is cached under this folder (Arrow files, memory-mapped "
                            "by every rank; keyed by the data files, tokenizer, template, seq_len, packing, format "
                            "options and seed; one process per node builds it, the others wait on a file lock). "
                            "auto: $XDG_CACHE_HOME/shardtune/data (~/.cache/shardtune/data), each node's own, when "
                            "pyarrow is installed and the folder writable; null: tokenise in memory at every start.")
    sources: list[SourceConfig] | None = Field(
        None, description="Several datasets mixed by weight instead of `path`: a list of {path, weight, format, "
                          "split, columns}. Rows are drawn in a seeded order (train.seed); the checkpoint keeps "
                          "each source's position, so a resume at any world size continues every source exactly.")

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, v: str | None) -> str | None:
        if v is not None and is_template_name(v) and v not in CHAT_TEMPLATES:
            raise ValueError(unknown_template_message(v))
        return v

    @property
    def has_val(self) -> bool:
        """A validation set is given: data.val_path or data.val_split."""
        return bool(self.val_path or self.val_split)

    @model_validator(mode="after")
    def _one_kind_of_source(self):
        if self.val_split and (self.val_path or self.sources):
            raise ValueError(f"data.val_split {self.val_split} holds out part of data.path; give it or "
                             f"{'data.val_path' if self.val_path else 'a data.val_path (data.sources are mixed)'}, "
                             "not both")
        if self.sources is not None:
            if self.path not in (None, "generated"):
                raise ValueError("give data.path or data.sources, not both")
            if not self.sources or sum(s.weight for s in self.sources) <= 0:
                raise ValueError("data.sources weights sum to 0; give at least one source a weight > 0")
        return self
