"""Packing tokenized examples into seq_len rows, and reading the rows back as micro-batches.

`PackedData` (flat tokens, target flags, example offsets, rows of example ids) is what packing
makes, the tokenised cache (cache.py) stores and maps back, and the loaders read: `build_row` makes
one row's (input_ids, labels, position_ids) by the micro-batch contract of dataset.py's docstring,
`PackedLoader` streams this rank's micro-batches; mix.py's loader draws rows of several. Below
dataset.py, cache.py and mix.py, which all use it. Imports no torch at import (the launcher's
preflight packs to count rows).
"""
from __future__ import annotations

from dataclasses import dataclass

from shardtune.errors import UserError
from shardtune.strategies import IGNORE_INDEX


# ---------------------------------------------------------------- packing
@dataclass
class PackedData:
    """Tokenized examples (flat) and the rows that pack them. Rows are lists of example ids."""

    tokens: list[int]
    targets: list[bool]
    offsets: list[int]          # example k is tokens[offsets[k]:offsets[k+1]]
    rows: list[list[int]]
    seq_len: int
    num_truncated: int
    num_dropped: int

    @property
    def num_rows(self) -> int:
        return len(self.rows)


def pack_examples(encoded: list[tuple[list[int], list[bool]]], seq_len: int, packing: bool, seed: int,
                  shuffle: bool = True) -> PackedData:
    """Truncate to seq_len, drop examples without a target, pack next-fit in a seeded order
    (`shuffle` False: in file order, so rows keep the examples' order)."""

    tokens, targets, offsets = [], [], [0]
    truncated = dropped = 0
    lengths = []
    for ids, mask in encoded:
        if len(ids) > seq_len:
            ids, mask = ids[:seq_len], mask[:seq_len]
            truncated += 1
        if not any(mask[1:]):  # position 0 has nothing before it to predict from
            dropped += 1
            continue
        tokens += ids
        targets += mask
        offsets.append(len(tokens))
        lengths.append(len(ids))
    if not lengths:
        raise UserError(f"no example has a target token within seq_len={seq_len} (all {dropped} too long or without "
                        "response); raise train.seq_len or check the data")
    rows = next_fit(lengths, seq_len, packing, seed, shuffle)
    return PackedData(tokens, targets, offsets, rows, seq_len, truncated, dropped)


def next_fit(lengths: list[int], seq_len: int, packing: bool, seed: int, shuffle: bool) -> list[list[int]]:
    """Rows of unit indices: next-fit in a seeded order (`shuffle` False: in order), one a row
    without `packing`."""
    import torch

    order = (torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist() if shuffle
             else range(len(lengths)))
    rows: list[list[int]] = []
    fill = seq_len
    for k in order:
        if packing and fill + lengths[k] <= seq_len:
            rows[-1].append(k)
            fill += lengths[k]
        else:
            rows.append([k])
            fill = lengths[k]
    return rows


def build_row(data: PackedData, row: list[int], pad_id: int) -> tuple[list[int], list[int], list[int]]:
    """(input_ids, labels, position_ids) of one row, each seq_len long (labels already shifted)."""
    ids, labels, pos = [], [], []
    for k in row:
        a, b = data.offsets[k], data.offsets[k + 1]
        ex, tg = data.tokens[a:b], data.targets[a:b]
        if not isinstance(ex, list):  # numpy views of the memory-mapped cache
            ex, tg = ex.tolist(), tg.tolist()
        ids += ex
        labels += [ex[i + 1] if tg[i + 1] else IGNORE_INDEX for i in range(len(ex) - 1)] + [IGNORE_INDEX]
        pos += range(len(ex))
    pad = data.seq_len - len(ids)
    return ids + [pad_id] * pad, labels + [IGNORE_INDEX] * pad, pos + list(range(pad))


# ---------------------------------------------------------------- the loader
class StreamOrder:
    """A data stream's order and position, shared by the loaders: global slot `g` of epoch
    g // num_rows reads item `index_at(g)` (a seeded permutation per epoch when shuffled); each
    micro-batch takes `micro_batch` slots a rank, `dp_size` ranks in turn; `state_dict()` is the
    position, resumable only on the same data (`MISMATCH`: the refusal, given both counts)."""

    MISMATCH = ("the checkpoint's data had {saved} rows, this data has {now}; resume with the same data, "
                "seq_len and tokenizer (or checkpoint.resume=never)")

    def __init__(self, num_rows: int, micro_batch: int, dp_rank: int, dp_size: int, seed: int, shuffle: bool):
        self.num_rows, self.micro_batch, self.dp_rank, self.dp_size = num_rows, micro_batch, dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.position = 0  # global stream slot of the next micro-batch
        self._perm_epoch, self._perm = -1, None

    def index_at(self, g: int) -> int:
        import torch

        epoch, index = divmod(g, self.num_rows)
        if not self.shuffle:
            return index
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch + 1)
            self._perm, self._perm_epoch = torch.randperm(self.num_rows, generator=gen), epoch  # 8 B a row
        return int(self._perm[index])

    def next_slots(self) -> list[int]:
        """This rank's slots of the next micro-batch; advances the stream by every rank's."""
        start = self.position + self.dp_rank * self.micro_batch
        self.position += self.micro_batch * self.dp_size
        return list(range(start, start + self.micro_batch))

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        epoch, index = divmod(self.position, self.num_rows)
        return {"epoch": epoch, "index": index, "num_rows": self.num_rows, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_rows") != self.num_rows:
            raise UserError(self.MISMATCH.format(saved=state.get("num_rows"), now=self.num_rows))
        self.position = int(state["epoch"]) * self.num_rows + int(state["index"])


class PackedLoader(StreamOrder):
    """Endless iterator of this rank's micro-batches; `state_dict()` is the stream position.

    `next(loader)` returns {"input_ids", "labels", "position_ids"}: (micro_batch, seq_len) long.
    Attributes: `num_rows` (rows per epoch), `rows_per_micro_batch` (B·D, global),
    `stats` (examples, truncated, dropped, rows, fill ratio) for the trainer to print.
    """

    def __init__(self, data: PackedData, micro_batch: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool, pad_id: int):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        super().__init__(data.num_rows, micro_batch, dp_rank, dp_size, seed, shuffle)
        self.data, self.pad_id = data, pad_id
        self.rows_per_micro_batch = micro_batch * dp_size
        used = sum(data.offsets[k + 1] - data.offsets[k] for r in data.rows for k in r)
        self.stats = {"examples": len(data.offsets) - 1, "truncated": data.num_truncated,
                      "dropped": data.num_dropped, "rows": data.num_rows,
                      "fill": used / (data.num_rows * data.seq_len)}

    def _row_at(self, g: int) -> list[int]:
        return self.data.rows[self.index_at(g)]

    def __next__(self) -> dict:
        import torch

        rows = [build_row(self.data, self._row_at(g), self.pad_id) for g in self.next_slots()]
        return {key: torch.tensor([r[i] for r in rows], dtype=torch.long)
                for i, key in enumerate(("input_ids", "labels", "position_ids"))}
