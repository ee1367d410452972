"""`train:` and `checkpoint:` — batch, steps, logging, process group; saving and resuming."""
from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from shardtune.config.base import _Section
from shardtune.errors import UserError

MAX_TIMEOUT_S = 365 * 86400  # timedelta and the c10d store take far more; no collective waits a year
OFF = {"false_is_off": True}  # YAML reads `off` as false: config/base.py lets these keys take it
WATCHDOG_ENV = "SHARDTUNE_WATCHDOG_S"  # wins over train.watchdog_s (train/durable/watchdog.py)


def seconds_or_off(value, name: str) -> float:
    """A number of seconds ≥ 0 (0 or `off`: off); anything else is a ValueError naming `name`."""
    if value is False or isinstance(value, str) and value.strip().lower() == "off":  # YAML reads off as false
        return 0.0
    try:
        s = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        s = float("nan")
    if not 0 <= s <= MAX_TIMEOUT_S:  # nan fails both
        raise ValueError(f"{name} = {value!r} is not a number of seconds; give e.g. 300 (0 or off: no watchdog)")
    return s


# the objectives each preference setting acts under (train.objective); set under another, it does nothing
ACTS_UNDER = {"reference": ("dpo",), "dpo_beta": ("dpo", "simpo"), "simpo_gamma": ("simpo",),
              "dpo_label_smoothing": ("dpo",)}

class TrainConfig(_Section):
    micro_batch: int = Field(4, ge=1, description="Sequences per rank per forward/backward.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step. Global batch = micro_batch "
                                                 "× grad_accum × data-parallel ranks.")
    seq_len: int = Field(128, ge=2, description="Tokens per sequence.")
    max_steps: int | None = Field(None, ge=1, le=10**9, description="Optimizer steps; None: derived from `epochs`.")
    epochs: float = Field(1.0, gt=0, le=10**6, description="Used when max_steps is None.")
    seed: int = Field(0, ge=0, lt=2**32, description="Seeds init, data order and dropout (0 to 2^32 - 1: torch's "
                                                     "generators take 64 bits, and the data order multiplies it).")
    log_every: int = Field(1, ge=1, description="Write metrics every k optimizer steps.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto: nccl with CUDA, else gloo.")
    timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S, description="Process-group timeout: a rank that "
                             "waits longer on a collective fails instead of hanging (at most a year).")
    gpu: str = Field("h100-80gb", description="GPU catalogue name for MFU and the plan (ignored for the device "
                                              "itself).")
    eval_every: int = Field(0, ge=0, description="Validation loss (data.val_path) and sample prompts every N "
                                                 "optimizer steps and at the end (0: at the end only).")
    loggers: list[Literal["tensorboard", "wandb"]] = Field(
        [], description="Also log each metrics.jsonl record to TensorBoard (event files in the run folder) and/or "
                        "W&B (offline without an API key); rank 0 only.")
    sample_prompts: list[str] = Field([], description="Prompts answered greedily at each evaluation, written to "
                                                      "samples.jsonl.")
    sample_max_new_tokens: int = Field(64, ge=1, le=1_000_000, description="Most tokens each sample prompt's answer "
                                                                         "gets.")
    threads: int | None = Field(None, ge=1, description="Intra-op threads per rank (None: this node's cores / its "
                                                        "ranks).")
    loss_chunks: int | None = Field(None, ge=1, description="Cross-entropy (with the LM head's projection) over this "
                                                            "many token chunks, so the full fp32 logits never exist "
                                                            "(None: 8 above a 32k vocabulary, else 1; 1: the full "
                                                            "computation; docs/loss.md).")
    compile: bool = Field(False, description="torch.compile each decoder layer before sharding.")
    objective: Literal["sft", "dpo", "simpo", "grpo"] = Field(
        "sft", description="sft: next-token loss on responses; dpo: Direct Preference Optimisation on "
                           "prompt/chosen/rejected pairs; simpo: SimPO on the same pairs, no reference (docs/dpo.md); "
                           "grpo: online RL on prompts with rewards, the `rl:` section (docs/rl.md).")
    reference: Literal["live", "precompute"] = Field(
        "live", description="dpo: the reference log-probs computed each step (live: LoRA's base with adapters off, "
                            "else a frozen copy sharded like the policy) or once before training and cached beside "
                            "the tokenised data (precompute).")
    dpo_beta: float = Field(0.1, gt=0, description="dpo: β, the KL strength (Rafailov et al. 2023 eq. 7); simpo: "
                                                   "β, the reward scale (SimPO uses 2 to 10).")
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: γ, the target reward margin (Meng et al. 2024 eq. 6).")
    dpo_label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo: ε, the share of pairs assumed flipped "
                                                                      "(conservative DPO; 0: plain DPO).")
    watchdog_s: float = Field(120.0, validate_default=True, json_schema_extra=OFF, description=(
        f"The hung-rank watchdog's floor: a rank whose heartbeat, or a job whose step count, stands still for "
        f"max(this, 10 × the longest step so far) seconds is ended, named (0 or off: no watchdog; the variable "
        f"{WATCHDOG_ENV}, when set, wins; docs/checkpoints.md)."))
    watchdog_first_step_s: float = Field(900.0, json_schema_extra=OFF, description=(
        "The watchdog's limit until every rank has finished its first step (compilation, warm-up of the "
        "collectives), in seconds (0 or off: none before the first step)."))
    max_bad_steps: int = Field(5, ge=1, description="Stop after this many consecutive steps with a non-finite "
                                                    "loss or gradient norm (each is skipped: no optimizer step).")

    @field_validator("watchdog_s", mode="before")
    @classmethod
    def _watchdog_s(cls, v):
        env = os.environ.get(WATCHDOG_ENV, "").strip()
        return seconds_or_off(env, WATCHDOG_ENV) if env else seconds_or_off(v, "train.watchdog_s")

    @field_validator("watchdog_first_step_s", mode="before")
    @classmethod
    def _watchdog_first_step_s(cls, v):
        return seconds_or_off(v, "train.watchdog_first_step_s")

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: str) -> str:
        from shardtune.catalog.gpus import resolve_gpu

        try:
            return resolve_gpu(v).name
        except UserError as e:
            raise ValueError(str(e)) from None

    def unused_settings(self) -> list[str]:
        """One line for each key the recipe or an override set that this objective ignores
        (`train.reference=precompute` under sft or simpo): a setting that does nothing is said, not
        silently accepted (issue 42)."""
        return [f"train.{key} is set but does nothing under train.objective {self.objective} (it acts under "
                f"{' and '.join(acts)}); remove it, or set train.objective"
                for key, acts in ACTS_UNDER.items()
                if key in self.model_fields_set and self.objective not in acts]

    def threads_per_rank(self, local_world_size: int) -> int:
        """`threads`, else the cores this process may run on / the ranks on its node (at least 1)."""
        if self.threads:
            return self.threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // max(1, local_world_size))


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0, description="Save every N optimizer steps (0: only at the end).")
    keep: int = Field(2, ge=1, description="Keep the newest K complete checkpoints.")
    resume: str = Field("auto", description="auto (newest complete checkpoint in the run folder) | never | a "
                                            "checkpoint path.")
    export_hf: bool = Field(False, description="Export a Hugging Face folder at the end of training.")
    save_final: bool = Field(True, description="Save a checkpoint after the last step.")
