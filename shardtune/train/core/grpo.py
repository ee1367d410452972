"""Online RL on the sharded step (`train.objective: grpo`, the `rl:` section, docs/rl.md): GRPO, DAPO
and Dr. GRPO with μ = 1 (one optimizer step a generation batch).

A step: every prompt of every micro-batch gets its group of G completions from the policy itself
(rl_generate.py: the FSDP2 weights gathered once for the decode), the rewards score them
(rewards.py), each group's advantages follow (rl_loss.py); then ONE all-reduce of [completions,
completion tokens] gives the global counts, and each micro-batch's forward/backward scores its
completions' tokens under the temperature-scaled policy (the LM head in chunks, chunked_loss.py),
with π_old = the same forward's detached log-probs (μ = 1: the ratio is 1, its gradient the policy
gradient). β > 0: a frozen reference built as DPO's (dpo_ref.py) adds the k3 KL. Rank 0 appends
every rank's completions with their rewards to <run_dir>/completions.jsonl.
"""
from __future__ import annotations

import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from shardtune.rules.loss import resolve_loss_chunks
from shardtune.strategies import STRATEGY
from shardtune.train.core.chunked_loss import IGNORE_INDEX, _loss_in_root_forward, chunked_token_logps
from shardtune.train.core.dpo_ref import AdaptersOffReference, build_reference_model
from shardtune.train.core.rewards import Rewards
from shardtune.train.core.rl_generate import Group, gathered, sample_group
from shardtune.train.core.rl_loss import group_advantages, reduce_loss, token_terms
from shardtune.train.core.step import StepResult, accumulation, clip_and_step
from shardtune.train.data.prompts import PromptData, PromptLoader, prompt_text

SEED_STRIDE = 1_000_003  # a prompt slot's generator: train.seed * SEED_STRIDE + slot


def token_logps(model, ids: torch.Tensor, labels: torch.Tensor, loss_chunks: int | None, temperature: float,
                autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(B, T) fp32 log-probs of `labels` (IGNORE_INDEX: 0) under softmax(logits / temperature), the head
    applied in chunks inside the root's forward."""
    lm = getattr(model, "module", model)
    k = resolve_loss_chunks(loss_chunks, lm.config.vocab_size)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    amp = torch.autocast(ids.device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()

    def scaled(hidden, weight, target, num_chunks):  # (h·Wᵀ)/τ = (h/τ)·Wᵀ
        return chunked_token_logps(hidden / temperature, weight, target, num_chunks)

    with amp, _loss_in_root_forward(lm, labels, k, scaled):
        out = model(input_ids=ids, position_ids=pos, logits_to_keep=torch.empty(0, dtype=torch.long,
                                                                                   device=ids.device))
    return out.loss.view(ids.shape)


def rows_of(prompts: list[list[int]], groups: list[Group], pad_id: int, device) -> dict:
    """The training rows of a micro-batch: prompt + completion, right-padded; labels on the completion."""
    seqs = [(p, g.tokens[i], g.mask[i]) for p, g in zip(prompts, groups) for i in range(g.tokens.shape[0])]
    width = max(len(p) + int(m.sum()) for p, _, m in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
    for r, (p, tok, m) in enumerate(seqs):
        c = tok[m]
        ids[r, :len(p)] = torch.tensor(p)
        ids[r, len(p):len(p) + len(c)] = c
        labels[r, len(p) - 1:len(p) - 1 + len(c)] = c  # labels[t] is the token after t
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


class GRPO:
    """The objective's step and evaluation (train/rank/loop.py calls them as DPO's)."""
    flops_factor = 1  # the reference's forward (rl.beta > 0) is not counted in the logged MFU
    step_tokens_fixed = False  # its rows are prompts: a step counts the completion tokens it trained on

    def __init__(self, cfg, data, val_data, tokenizer, rank: int, dp_rank: int, dp_size: int, run_dir: Path | None,
                 reference=None, reshard_after_forward: bool = True):
        self.rl, self.data, self.val, self.tok = cfg.rl, data, val_data, tokenizer
        self.rewards = Rewards(cfg.rl)
        self.rank, self.dp_rank, self.dp_size, self.seed = rank, dp_rank, dp_size, cfg.train.seed
        self.path = run_dir / "completions.jsonl" if run_dir is not None else None
        self.reference, self.reshard = reference, reshard_after_forward  # reference: TokenReference or None
        self.adapters_reference = cfg.rl.beta > 0 and cfg.lora.rank > 0
        self.metrics = ("reward", "reward_std", *(f"reward/{k}" for k in self.rewards.labels), "completion_len",
                        "clip_frac", "entropy", *(("kl",) if cfg.rl.beta > 0 else ()))

    def start(self, model, ctx, marks: list) -> None:
        """The start-up lines (rank 0): what generates, what rewards (a user's: its file), and the held-out
        reward of the model before training (data.val_path / val_split; collective). LoRA with β > 0: the
        reference is this policy with its adapters off (no second copy)."""
        if self.adapters_reference:
            self.reference = TokenReference(model, AdaptersOffReference(model))
        if ctx.rank == 0:
            files = ", ".join(f"{p}:{fn}" for p, fn in self.rl.file_rewards())
            print(f"shardtune: grpo ({self.rl.loss}): {self.rl.num_generations} completions a prompt, at most "
                  f"{self.rl.max_new_tokens} tokens, temperature {self.rl.temperature:g}, beta {self.rl.beta:g}, "
                  f"clip [1 - {self.rl.epsilon:g}, 1 + {self.rl.clip_high:g}]"
                  + ("; reference: the base (LoRA adapters off)" if self.adapters_reference else "")
                  + f"; rewards {self.rewards.describe()}"
                  + (f"; user reward code loaded from {files} (the recipe's rl.reward)" if files else ""), flush=True)
        if self.val is not None:
            before = self.evaluate(model, list(range(self.dp_rank, len(self.val), self.dp_size)), ctx.device,
                                   group=ctx.dp_group)
            if ctx.rank == 0:
                print(f"shardtune: held-out prompts: reward before training {before['val_reward']:.4f} over "
                      f"{len(self.val)} prompts (greedy); val_reward in metrics.jsonl is the same after", flush=True)
        marks.append(("grpo set-up", time.perf_counter()))

    def blocks_memory_tracker(self) -> bool:
        return True  # generation's forwards and gathered weights are no training step's categories

    def _group(self, model, index: int, slot: int, greedy: bool = False) -> Group:
        return sample_group(model, self.data.ids[index] if not greedy else self.val.ids[index],
                            1 if greedy else self.rl.num_generations, max_new_tokens=self.rl.max_new_tokens,
                            stop_ids=[self.tok.eos_id], pad_id=self.tok.pad_id,
                            temperature=0.0 if greedy else self.rl.temperature, top_p=self.rl.top_p,
                            seed=self.seed * SEED_STRIDE + slot)

    def _score(self, data, index: int, group: Group) -> list[list[float]]:
        ids = group.completion_ids()
        texts = [self.tok.decode([t for t in c if t != self.tok.eos_id], skip_special_tokens=True) for c in ids]
        rec = data.records[index]
        columns = {k: [v] * len(ids) for k, v in rec["columns"].items()}
        prompts = [prompt_text(rec["prompt"])] * len(ids)
        per_fn = self.rewards.score(prompts, texts, columns, ids, rank=self.rank)
        self._texts = texts
        return per_fn

    def step(self, model, optimizer, scheduler, micro_batches: list[dict], opts, *, dp_group=None, dp_size: int,
             activations=None) -> StepResult:
        optimizer.zero_grad(set_to_none=True)
        device, G = micro_batches[0]["index"].device, self.rl.num_generations
        step_no, rows, batches = scheduler.last_epoch + 1, [], []
        with gathered(model, self.reshard):
            for mb in micro_batches:
                groups, prompts, rewards, per_fns, stds = [], [], [], [], []
                for index, slot in zip(mb["index"].tolist(), mb["slot"].tolist()):
                    g = self._group(model, index, slot)
                    per_fn = self._score(self.data, index, g)
                    total = torch.tensor(self.rewards.total(per_fn))
                    adv, std = group_advantages(total, G, self.rl.scales_rewards)
                    groups.append(g)
                    prompts.append(self.data.ids[index])
                    rewards.append(torch.stack([total, *(torch.tensor(v) for v in per_fn)], 1))  # (G, 1 + fns)
                    per_fns.append(adv)
                    stds.append(std)
                    rows += [{"step": step_no, "slot": slot, "prompt": prompt_text(self.data.records[index]["prompt"]),
                              "completion": t, "completion_ids": ids, "reward": float(total[i]),
                              "advantage": float(adv[i]),
                              **{f"reward/{k}": v[i] for k, v in zip(self.rewards.labels, per_fn)}}
                             for i, (t, ids) in enumerate(zip(self._texts, g.completion_ids()))]
                batch = rows_of(prompts, groups, self.tok.pad_id, device)
                batch.update(advantages=torch.cat(per_fns).to(device), rewards=torch.cat(rewards).to(device),
                             std=torch.cat(stds), entropy=torch.cat([g.entropy_sum for g in groups]).to(device))
                batches.append(batch)
        counts = torch.stack([torch.tensor(sum(b["input_ids"].shape[0] for b in batches)),
                              torch.stack([(b["labels"] != IGNORE_INDEX).sum().cpu() for b in batches]).sum()]
                             ).to(device)
        dist.all_reduce(counts, group=dp_group)  # ONE all-reduce: [completions, completion tokens]
        n_seq, n_tok = counts[0].double(), counts[1].double()
        loss_sum, metric = torch.zeros((), dtype=torch.float64, device=device), torch.zeros(
            len(self.metrics), dtype=torch.float64, device=device)
        for i, b in enumerate(batches):
            mask = b["labels"] != IGNORE_INDEX
            ref = None
            if self.reference is not None:
                ref = self.reference.token_logps(b, opts, self.rl.temperature)
            with accumulation(model, last=i == len(batches) - 1):
                with activations.micro_batch() if activations else nullcontext():
                    logps = token_logps(model, b["input_ids"], b["labels"], opts.loss_chunks, self.rl.temperature,
                                        opts.autocast_dtype)
                terms = token_terms(logps, logps.detach(), b["advantages"], self.rl.epsilon, self.rl.clip_high,
                                    self.rl.beta, ref)
                part = reduce_loss(terms.loss, mask, self.rl.loss, num_completions=n_seq.float(),
                                   num_tokens=n_tok.float(), max_new_tokens=self.rl.max_new_tokens)
                (part * dp_size).backward()
            loss_sum += part.detach().double()
            metric += self._metric_sums(b, mask, terms, n_seq, n_tok)
        norm, lr, skipped = clip_and_step(model, optimizer, scheduler, loss_sum.float(), opts)
        self._write(rows)
        return StepResult(loss_part=loss_sum.float(), grad_norm=norm.detach(), lr=lr, num_tokens=counts[1],
                          skipped=skipped, parts=dict(zip(self.metrics, metric)))

    def _metric_sums(self, b: dict, mask, terms, n_seq, n_tok) -> torch.Tensor:
        """This rank's parts of the metrics' global means (order: self.metrics)."""
        m = mask.double()
        per_row = b["rewards"].double().sum(0) / n_seq  # (1 + fns,)
        lens = m.sum() / n_seq
        tokens = n_tok.clamp(min=1)
        out = [per_row[0], b["std"].double().sum() / (n_seq / self.rl.num_generations), *per_row[1:], lens,
               (terms.clipped.double() * m).sum() / tokens, b["entropy"].double().sum() / tokens]
        if terms.kl is not None:
            out.append((terms.kl.detach().double() * m).sum() / n_tok.clamp(min=1))
        return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=m.device) for v in out])

    def _write(self, rows: list[dict]) -> None:
        """Rank 0 appends every rank's completions (collective)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            every = [rows]
        else:
            every = [None] * dist.get_world_size() if self.rank == 0 else None
            dist.gather_object(rows, every, dst=0)
        if self.path is not None and every is not None:
            with self.path.open("a") as f:
                for r in sorted((r for part in every if part for r in part), key=lambda r: (r["slot"], 0)):
                    f.write(json.dumps(r) + "\n")

    @torch.no_grad()
    def evaluate(self, model, val_indices: list[int], device, opts=None, group=None) -> dict:
        """Held-out prompts, one greedy completion each: val_reward (and val_reward/<fn>), the mean over
        every rank's prompts (collective)."""
        sums = torch.zeros(2 + len(self.rewards.labels), dtype=torch.float64, device=device)
        with gathered(model, self.reshard):
            for index in val_indices:
                g = self._group(model, index, 0, greedy=True)
                per_fn = self._score(self.val, index, g)
                total = self.rewards.total(per_fn)
                sums += torch.tensor([total[0], *(v[0] for v in per_fn), 1.0], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=group)
        n = float(sums[-1])
        keys = ("val_reward", *(f"val_reward/{k}" for k in self.rewards.labels))
        return {k: float(v) / n if n else float("nan") for k, v in zip(keys, sums[:-1])}


class TokenReference:
    """Reference per-token log-probs from a frozen copy built as DPO's (dpo_ref.build_reference_model),
    or, under LoRA, from the policy itself with its adapters off (dpo_ref.AdaptersOffReference)."""

    def __init__(self, model, adapters: AdaptersOffReference | None = None):
        self.model, self.adapters = model, adapters

    @torch.no_grad()
    def token_logps(self, batch: dict, opts, temperature: float) -> torch.Tensor:
        with self.adapters.off() if self.adapters else nullcontext():
            return token_logps(self.model, batch["input_ids"], batch["labels"], opts.loss_chunks, temperature,
                               opts.autocast_dtype)


def set_up_grpo(cfg, ctx, tokenizer, run_dir: Path):
    """(the prompt loader, this rank's held-out prompt indices or None, the GRPO objective)."""
    data = PromptData(cfg.data, tokenizer, "train", cfg.train.seq_len)
    loader = PromptLoader(data, cfg.train.micro_batch, ctx.dp_rank, ctx.dp_size, cfg.train.seed, cfg.data.shuffle)
    val = PromptData(cfg.data, tokenizer, "val", cfg.train.seq_len) if cfg.data.has_val else None
    val_indices = list(range(ctx.dp_rank, len(val), ctx.dp_size)) if val is not None else None
    full = cfg.rl.beta > 0 and not cfg.lora.rank  # LoRA's reference is the policy's base: set in GRPO.start
    reference = TokenReference(build_reference_model(cfg, ctx.mesh, ctx.device)) if full else None
    objective = GRPO(cfg, data, val, tokenizer, ctx.rank, ctx.dp_rank, ctx.dp_size,
                     run_dir if ctx.rank == 0 else None, reference,
                     STRATEGY[cfg.parallel.strategy].reshard_after_forward)
    return loader, val_indices, objective
