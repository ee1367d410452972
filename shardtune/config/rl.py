"""`rl:` — online reinforcement learning (`train.objective: grpo`): GRPO, DAPO and Dr. GRPO (docs/rl.md)."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from shardtune.config.base import _Section

BUILTIN_REWARDS = ("exact_match", "regex", "length")
LOSSES = ("grpo", "dapo", "dr_grpo")


class RewardConfig(_Section):
    """One reward function of `rl.reward`; the rewards are summed with their weights."""

    name: str = Field(description="exact_match (the completion, stripped, equals the data column `column`), "
                                  "regex (1 where `pattern` matches: re.search, or re.fullmatch with "
                                  "`full: true`), length (1 − |tokens − target| / rl.max_new_tokens), or "
                                  "'path/to/file.py:function' (your own: fn(prompts, completions, **columns) -> "
                                  "list of numbers, loaded only from that path, relative to the recipe).")
    weight: float = Field(1.0, description="Its weight in the summed reward.")
    column: str | None = Field(None, description="exact_match: the data column holding the answer.")
    pattern: str | None = Field(None, description="regex: the pattern (Python re).")
    full: bool = Field(False, description="regex: the whole stripped completion must match.")
    target: int | None = Field(None, ge=0, description="length: the completion length (tokens) scored 1.")
    label: str | None = Field(None, pattern=r"^[A-Za-z_][\w-]*$", description="Its name in metrics.jsonl "
                              "(reward/<label>; default: the built-in's or the function's name).")

    @model_validator(mode="after")
    def _fields(self):
        if self.name not in BUILTIN_REWARDS and ":" not in self.name:
            raise ValueError(f"unknown reward {self.name!r}; give one of {', '.join(BUILTIN_REWARDS)} or "
                             "'path/to/file.py:function'")
        if ":" in self.name:
            path, _, fn = self.name.rpartition(":")
            if not path.endswith(".py") or not fn.isidentifier():
                raise ValueError(f"reward {self.name!r} is not 'path/to/file.py:function'")
        needs = {"exact_match": "column", "regex": "pattern", "length": "target"}.get(self.name)
        if needs and getattr(self, needs) is None:
            raise ValueError(f"reward {self.name} needs `{needs}`")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"reward regex pattern {self.pattern!r} does not compile: {e}") from None
        return self

    @property
    def key(self) -> str:
        """Its name in metrics.jsonl: reward/<label>."""
        if self.label:
            return self.label
        return self.name.rpartition(":")[2] if ":" in self.name else self.name


class RLConfig(_Section):
    num_generations: int = Field(8, ge=2, le=4096, description="Completions sampled per prompt (G, the group "
                                                                "whose rewards give each one's advantage).")
    max_new_tokens: int = Field(64, ge=1, le=1_000_000, description="Most tokens a completion gets (Dr. GRPO's "
                                                                    "constant normaliser).")
    temperature: float = Field(1.0, gt=0, le=100, description="Sampling temperature; the training log-probs use "
                                                              "the same scaled logits.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens whose "
                                                      "probability reaches top_p.")
    reward: list[RewardConfig] = Field([], description="The reward functions, summed with their weights (a list "
                                                       "of {name, weight, ...}).")
    beta: float = Field(0.0, ge=0, description="KL penalty to the reference (k3 estimator; 0: no reference is "
                                               "built, as DAPO and Dr. GRPO).")
    epsilon: float = Field(0.2, gt=0, lt=1, description="Clip: the ratio is clipped below at 1 − epsilon.")
    epsilon_high: float | None = Field(None, gt=0, description="Clip above at 1 + epsilon_high (DAPO's "
                                                               "clip-higher, 0.28); None: epsilon.")
    loss: Literal["grpo", "dapo", "dr_grpo"] = Field("grpo", description="grpo: each completion's token mean, then "
                                                                         "the mean over completions; dapo: the "
                                                                         "token mean over the whole batch; dr_grpo: "
                                                                         "the token sum / (completions × "
                                                                         "max_new_tokens), no std scaling.")
    scale_rewards: bool | None = Field(None, description="Divide each advantage by its group's reward std "
                                                         "(None: yes, but no under dr_grpo).")
    iterations: int = Field(1, ge=1, le=1, description="Optimizer steps per generation batch (μ); 1 only: the "
                                                       "old log-probs are the detached current ones.")

    @field_validator("reward")
    @classmethod
    def _labels(cls, v: list[RewardConfig]) -> list[RewardConfig]:
        labels = [r.key for r in v]
        if len(set(labels)) != len(labels):
            raise ValueError(f"rewards {labels} repeat a name; metrics name each reward once: give each a label")
        return v

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def scales_rewards(self) -> bool:
        return self.loss != "dr_grpo" if self.scale_rewards is None else self.scale_rewards

    def file_rewards(self) -> list[tuple[str, str]]:
        """(path, function) of each user reward."""
        return [tuple(r.name.rsplit(":", 1)) for r in self.reward if ":" in r.name]
