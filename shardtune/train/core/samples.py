"""`train.sample_prompts`: what the model answers now, at every evaluation (docs/loop.md).

Each prompt is rendered as training renders a prompt/response example with an empty response
(the data's template and system prompt: the chat template's assistant header, or bos + prompt),
cut before the first target token, and answered greedily by `sampling.generate_ids` on the
training model itself: every rank runs it in lockstep (an FSDP2 model gathers its layers for
each forward), a DDP model's inner module answers on each rank alike. Rank 0 appends one line
per prompt to <run_dir>/samples.jsonl: {step, prompt, prompt_ids, completion_ids, completion}.
"""
from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from shardtune.train.core.sampling import generate_ids
from shardtune.train.data.dataset import encode_example


def sample_prompt_ids(prompt: str, tokenizer, data_cfg) -> list[int]:
    """The ids the model sees before its answer, as a training example's prompt part."""
    ids, mask = encode_example({"prompt": prompt, "response": ""}, tokenizer, data_cfg.template,
                               system_prompt=data_cfg.system_prompt)
    return ids[:mask.index(True)] if True in mask else ids


class Sampler:
    """The prompts' ids, rendered once; `write(model, step)` answers them (collective)."""

    def __init__(self, prompts: list[str], tokenizer, data_cfg, max_new_tokens: int, path: Path | None) -> None:
        self.prompts, self.tok, self.max_new_tokens, self.path = prompts, tokenizer, max_new_tokens, path
        self.ids = [sample_prompt_ids(p, tokenizer, data_cfg) for p in prompts]

    def write(self, model: nn.Module, step: int) -> list[dict]:
        """Every rank calls it; rank 0 (path set) appends the answers to samples.jsonl."""
        eos = self.tok.eos_id
        rows = []
        for prompt, ids in zip(self.prompts, self.ids):
            out = generate_ids(model, ids, max_new_tokens=self.max_new_tokens, stop_ids=[eos])
            text = self.tok.decode([t for t in out if t != eos], skip_special_tokens=True)
            rows.append({"step": step, "prompt": prompt, "prompt_ids": ids, "completion_ids": out,
                         "completion": text})
        if self.path is not None:
            with Path(self.path).open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        return rows
