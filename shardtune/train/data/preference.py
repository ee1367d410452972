"""Preference pairs (`train.objective: dpo`): rows of prompt + chosen + rejected, tokenised with
the prompt masked and packed so that a pair's two sides always share one row (docs/dpo.md).

Accepted rows (after `data.columns`): `prompt` (a string or a list of messages) with `chosen` and
`rejected` strings; or `chosen` / `rejected` message lists (UltraFeedback's layout: each the whole
conversation, the prompt turns first), the prompt being their common turns (or `prompt`). Each
side is encoded as an SFT example (dataset.encode_example: the chat template or the plain one)
whose only targets are the final response and its end token.

Packing: pair i is examples 2i (chosen) and 2i+1 (rejected) of a PackedData; a row holds whole
pairs, chosen before rejected, position ids restarting at each side (so no attention crosses
them). A step's sequence k of a row is found from those restarts (train/core/dpo.py), so the
micro-batch contract is the SFT one; `PairLoader` adds `ref_logps` (B, P, 2) when the reference
log-probs were precomputed. A pair longer than seq_len is cut at the end of its longer side(s).
"""
from __future__ import annotations

from shardtune.errors import UserError
from shardtune.train.data.dataset import _check_fills, encode_example, resolve_cache_dir
from shardtune.train.data.packing import PackedData, PackedLoader, next_fit
from shardtune.train.data.sources import ROLES, hold_out, read_records

PAIR_VERSION = 1


def _messages(v, where: str, key: str) -> list[dict]:
    if not isinstance(v, list) or not all(isinstance(m, dict) and m.get("role") in ROLES and
                                          isinstance(m.get("content"), str) for m in v):
        raise UserError(f"{where}: {key!r} must be a string or a list of {{role, content}} messages "
                        f"(roles {', '.join(ROLES)})")
    return [{"role": m["role"], "content": m["content"]} for m in v]


def _side(v, prompt: list[dict] | None, where: str, key: str) -> tuple[list[dict] | None, str]:
    """(the prompt turns a message-list side carries, its response text)."""
    if isinstance(v, str):
        return None, v
    msgs = _messages(v, where, key)
    if prompt is not None and msgs[:len(prompt)] == prompt:
        msgs = msgs[len(prompt):] if len(msgs) > len(prompt) else msgs
        if len(msgs) == 1 and msgs[0]["role"] == "assistant":
            return prompt, msgs[0]["content"]
    if not msgs or msgs[-1]["role"] != "assistant":
        raise UserError(f"{where}: {key!r} must end with an assistant message (the response)")
    return msgs[:-1], msgs[-1]["content"]


def normalize_pair(obj, where: str, want: str = "auto", columns: dict[str, str] | None = None) -> dict:
    """One row → {"prompt": str | "messages": [...], "chosen": str, "rejected": str}."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected an object with 'prompt', 'chosen' and 'rejected', got {type(obj).__name__}")
    if columns:
        obj = {**obj, **{ours: obj[theirs] for ours, theirs in columns.items()}}
    missing = [k for k in ("chosen", "rejected") if obj.get(k) is None]
    if missing:
        raise UserError(f"{where}: train.objective=dpo needs 'prompt', 'chosen' and 'rejected' but the row has "
                        f"columns {sorted(obj)[:8]} (no {' or '.join(repr(k) for k in missing)}); give preference "
                        "pairs or map your columns with data.columns")
    prompt = obj.get("prompt")
    prompt_msgs = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                   else None if prompt is None else _messages(prompt, where, "prompt"))
    turns_c, chosen = _side(obj["chosen"], prompt_msgs, where, "chosen")
    turns_r, rejected = _side(obj["rejected"], prompt_msgs, where, "rejected")
    for key, text in (("chosen", chosen), ("rejected", rejected)):
        if not text.strip():
            raise UserError(f"{where}: the {key!r} side is empty; every pair needs a non-empty chosen and rejected "
                            "response")
    if turns_c is None and turns_r is None:  # two strings
        if not isinstance(prompt, str):
            raise UserError(f"{where}: string 'chosen'/'rejected' need a string 'prompt' (or give message lists)")
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    turns = turns_c if turns_c is not None else turns_r
    if turns_c is not None and turns_r is not None and turns_c != turns_r:
        raise UserError(f"{where}: 'chosen' and 'rejected' have different prompt turns; a pair answers one prompt")
    if not turns:
        raise UserError(f"{where}: the pair has no prompt (no 'prompt' and no turns before the responses)")
    return {"messages": turns, "chosen": chosen, "rejected": rejected}


def generated_pairs(num_pairs: int, seed: int) -> list[dict]:
    """The built-in generated tasks (train/data/datagen.py) as pairs: chosen the right answer,
    rejected the answer reversed (a sum + 1 where that reads the same)."""
    from shardtune.train.data.datagen import generate_examples

    pairs = []
    for ex in generate_examples(num_pairs, seed):
        right = ex["response"]
        wrong = right[::-1] if right[::-1] != right else (str(int(right) + 1) if right.isdigit() else right + "?")
        pairs.append({"prompt": ex["prompt"], "chosen": right, "rejected": wrong})
    return pairs


def read_pairs(data_cfg, part: str = "train") -> list[dict]:
    """The pairs of data_cfg's path (None or 'generated': `generated_pairs`), `part` of data.val_split's
    split; refuses a set whose every pair has chosen == rejected."""
    if data_cfg.path in (None, "generated"):
        pairs = generated_pairs(data_cfg.generated_examples, data_cfg.generated_seed)
        pairs = hold_out(pairs, data_cfg.val_split, part, data_cfg.path) if data_cfg.val_split else pairs
    else:
        pairs = read_records(data_cfg, part, normalize_pair)
    if all(p["chosen"] == p["rejected"] for p in pairs):
        raise UserError(f"dataset {str(data_cfg.path)!r}: chosen == rejected in every one of its {len(pairs)} pairs"
                        f"{' held out' if part == 'val' else ''}, so there is no preference to learn; check the "
                        "columns (data.columns)")
    return pairs


def _last_run_only(mask: list[bool]) -> list[bool]:
    """Only the final run of targets (the response of this side) stays a target."""
    end = max((i for i, t in enumerate(mask) if t), default=-1)
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return [start <= i <= end for i in range(len(mask))]


def encode_pair(pair: dict, tokenizer, data_cfg) -> list[tuple[list[int], list[bool]]]:
    """[(ids, is_target) of prompt + chosen, of prompt + rejected]: the response's tokens are targets."""
    out = []
    for side in ("chosen", "rejected"):
        rec = ({"messages": [*pair["messages"], {"role": "assistant", "content": pair[side]}]} if "messages" in pair
               else {"prompt": pair["prompt"], "response": pair[side]})
        ids, mask = encode_example(rec, tokenizer, data_cfg.template, system_prompt=data_cfg.system_prompt)
        out.append((ids, _last_run_only(mask)))
    return out


def _fit(n_c: int, n_r: int, seq_len: int) -> tuple[int, int]:
    """Lengths kept of the two sides so that they share one row of seq_len tokens."""
    if n_c + n_r <= seq_len:
        return n_c, n_r
    half = seq_len // 2
    if n_c <= half:
        return n_c, seq_len - n_c
    if n_r <= half:
        return seq_len - n_r, n_r
    return half, seq_len - half


def pack_pairs(encoded: list[list[tuple[list[int], list[bool]]]], seq_len: int, packing: bool, seed: int,
               shuffle: bool = True) -> PackedData:
    """Pairs → PackedData (examples 2i, 2i+1 = chosen, rejected of kept pair i); rows hold whole pairs."""
    tokens, targets, offsets, lengths = [], [], [0], []
    truncated = dropped = 0
    for (ids_c, m_c), (ids_r, m_r) in encoded:
        keep_c, keep_r = _fit(len(ids_c), len(ids_r), seq_len)
        truncated += keep_c < len(ids_c) or keep_r < len(ids_r)
        sides = [(ids_c[:keep_c], m_c[:keep_c]), (ids_r[:keep_r], m_r[:keep_r])]
        if not all(any(m[1:]) for _, m in sides):
            dropped += 1
            continue
        for ids, mask in sides:
            tokens += ids
            targets += mask
            offsets.append(len(tokens))
        lengths.append(keep_c + keep_r)
    if not lengths:
        raise UserError(f"no pair keeps a response token on both sides within seq_len={seq_len} (all {dropped} "
                        "dropped); raise train.seq_len or shorten the prompts")
    rows = [[i for k in row for i in (2 * k, 2 * k + 1)] for row in next_fit(lengths, seq_len, packing, seed, shuffle)]
    return PackedData(tokens, targets, offsets, rows, seq_len, truncated, dropped)


def pair_cache_inputs(data_cfg, seq_len: int, tokenizer, seed: int) -> dict:
    """What the tokenised pairs depend on: the SFT data cache's inputs, marked as pairs."""
    from shardtune.train.data.cache import cache_inputs

    return {**cache_inputs(data_cfg, seq_len, tokenizer, seed), "pairs": PAIR_VERSION}


def build_pair_dataset(data_cfg, seq_len: int, tokenizer, seed: int, shuffle: bool | None = None,
                       part: str = "train") -> PackedData:
    """Read, tokenise and pack the pairs (through the tokenised cache when data.cache_dir allows);
    `part` "val": the held-out pairs (data.val_split's, or data_cfg.path's all), in file order."""
    shuffle = data_cfg.shuffle if shuffle is None else shuffle

    def build() -> PackedData:
        pairs = read_pairs(data_cfg, part)
        return pack_pairs([encode_pair(p, tokenizer, data_cfg) for p in pairs], seq_len, data_cfg.packing, seed,
                          shuffle)

    cache_dir = resolve_cache_dir(data_cfg.cache_dir)
    if cache_dir is None or part != "train":
        return build()
    from shardtune.train.data.cache import cached_packed, key_of

    inputs = pair_cache_inputs(data_cfg, seq_len, tokenizer, seed)
    return cached_packed(cache_dir, key_of(inputs), build, inputs, tokenizer.vocab_size)


def ref_slots(data: PackedData, rows: list[list[int]], per_example, seq_len: int):
    """(B, P, 2) float32: per_example[k] of each row's pairs at the slots train/core/dpo.py sums into."""
    import torch

    out = torch.zeros(len(rows), (seq_len + seq_len % 2) // 2, 2)
    for b, row in enumerate(rows):
        for j in range(len(row) // 2):
            out[b, j, 0], out[b, j, 1] = float(per_example[row[2 * j]]), float(per_example[row[2 * j + 1]])
    return out


class PairLoader(PackedLoader):
    """PackedLoader over pairs; with `ref` (per-example reference log-probs) set, each micro-batch also
    carries them as `ref_logps` (B, P, 2)."""

    ref = None

    def __next__(self) -> dict:
        start = self.position + self.dp_rank * self.micro_batch
        rows = [self._row_at(g) for g in range(start, start + self.micro_batch)]
        batch = super().__next__()
        if self.ref is not None:
            batch["ref_logps"] = ref_slots(self.data, rows, self.ref, self.data.seq_len)
        return batch


def build_pair_loader(data_cfg, train_cfg, tokenizer, dp_rank: int, dp_size: int, seed: int) -> PairLoader:
    """This data-parallel rank's loader of pairs (the SFT loader's order guarantee)."""
    data = build_pair_dataset(data_cfg, train_cfg.seq_len, tokenizer, seed)
    _check_fills(data.num_rows, train_cfg, dp_size)
    return PairLoader(data, train_cfg.micro_batch, dp_rank, dp_size, seed, data_cfg.shuffle, tokenizer.pad_id)


def pack_val_pairs(data_cfg, seq_len: int, tokenizer) -> PackedData:
    """The held-out pairs (data.val_split's share of data.path, else data.val_path) packed in file order."""
    cfg = data_cfg if data_cfg.val_split else data_cfg.model_copy(update={"path": data_cfg.val_path})
    return build_pair_dataset(cfg, seq_len, tokenizer, 0, shuffle=False, part="val")


def check_preference_data(cfg, world_size: int) -> None:
    """Before any process: the pairs read, tokenised and packed as the ranks will, one global batch of
    rows, and the held-out pairs."""
    from shardtune.train.data.dataset import build_tokenizer

    if cfg.data.sources:
        raise UserError("train.objective=dpo reads one dataset (data.path); data.sources mixing is for sft")
    if cfg.data.train_on_inputs:
        raise UserError("data.train_on_inputs applies to sft; dpo scores the responses only (drop it)")
    tok = build_tokenizer(cfg.data, cfg.model.name, cfg.model.trust_remote_code)
    data = build_pair_dataset(cfg.data, cfg.train.seq_len, tok, cfg.train.seed)
    _check_fills(data.num_rows, cfg.train, world_size)
    if cfg.data.has_val:
        pack_val_pairs(cfg.data, cfg.train.seq_len, tok)
