"""Several datasets mixed by weight (`data.sources`) into one world-size-independent row stream.

Each source is packed on its own (dataset.build_dataloader packs them and hands them here) and
read in its own per-epoch seeded order (packing.PackedLoader's). Global stream row g comes from
source k with probability weight_k / Σ weights, chosen by a uniform draw seeded by (train.seed, g)
alone, so the choice never depends on the world size or on where a run was resumed. Every rank walks the whole global
micro-batch (B·D choices), so every rank holds the same per-source positions; it builds only its
own B rows. state_dict: the global position and each source's consumed row count (JSON values).
"""
from __future__ import annotations

import bisect
import random

import torch

from shardtune.errors import UserError
from shardtune.train.data.packing import PackedData, PackedLoader, build_row


class MixedLoader:
    """Endless iterator of this rank's micro-batches drawn from several sources by weight."""

    def __init__(self, parts: list[PackedLoader], weights: list[float], micro_batch: int, dp_rank: int,
                 dp_size: int, seed: int, pad_id: int):
        self.parts, self.micro_batch, self.dp_rank, self.dp_size = parts, micro_batch, dp_rank, dp_size
        self.seed, self.pad_id = seed, pad_id
        total = sum(weights)
        self._cum = [sum(weights[: k + 1]) / total for k in range(len(weights))]
        self.num_rows = sum(p.num_rows for k, p in enumerate(parts) if weights[k] > 0)
        self.rows_per_micro_batch = micro_batch * dp_size
        self.position = 0
        self.consumed = [0] * len(parts)
        self.stats = {key: sum(p.stats[key] for p in parts) for key in ("examples", "truncated", "dropped", "rows")}
        self.stats["fill"] = sum(p.stats["fill"] * p.num_rows for p in parts) / self.stats["rows"]

    def source_of(self, g: int) -> int:
        """The source of global stream row g (a function of seed and g only)."""
        u = random.Random(self.seed * 1_000_003 + g).random()
        return min(bisect.bisect_right(self._cum, u), len(self._cum) - 1)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        rows = []
        mine = range(self.dp_rank * self.micro_batch, (self.dp_rank + 1) * self.micro_batch)
        for i in range(self.rows_per_micro_batch):
            k = self.source_of(self.position + i)
            if i in mine:
                part = self.parts[k]
                rows.append(build_row(part.data, part._row_at(self.consumed[k]), self.pad_id))
            self.consumed[k] += 1
        self.position += self.rows_per_micro_batch
        return {key: torch.tensor([r[i] for r in rows], dtype=torch.long)
                for i, key in enumerate(("input_ids", "labels", "position_ids"))}

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "num_rows": self.num_rows,
                "sources": [{"num_rows": p.num_rows, "consumed": c} for p, c in zip(self.parts, self.consumed)]}

    def load_state_dict(self, state: dict) -> None:
        got = [s.get("num_rows") for s in state.get("sources") or []]
        want = [p.num_rows for p in self.parts]
        if got != want:
            raise UserError(f"the checkpoint's data sources had {got} rows, these have {want}; resume with the same "
                            "data.sources, seq_len and tokenizer (or checkpoint.resume=never)")
        self.position = int(state["position"])
        self.consumed = [int(s["consumed"]) for s in state["sources"]]


def build_mixed_loader(sources: list[tuple[PackedData, float]], micro_batch: int, dp_rank: int, dp_size: int,
                       seed: int, shuffle: bool, pad_id: int) -> MixedLoader:
    """The loader of `data.sources` from each source's packed data (packed with seed + k, its k)
    and weight; each source is shuffled with its own seed, seed + k."""
    parts = [PackedLoader(data, 1, 0, 1, seed + k, shuffle, pad_id) for k, (data, _) in enumerate(sources)]
    return MixedLoader(parts, [w for _, w in sources], micro_batch, dp_rank, dp_size, seed, pad_id)
