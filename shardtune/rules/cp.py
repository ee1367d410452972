"""Context parallelism's rules (parallel.cp): which runs split the sequence over cp ranks, for the
config, the trainer's launch checks and the planner alike (one function, `check_cp`); which strategies
cp composes with is strategies.py's part, beside tp's (it reads the Strategy records, which import this
module). The mechanism and why: docs/long-context.md. Imports no torch.

What composes with cp > 1 (each tested in tests/dist/test_cp.py or tests/e2e/test_cp_cli.py):
FSDP2 strategies (zero2, zero3, hsdp), tensor parallelism (tp x cp), fp32 / bf16-mixed / bf16,
AC none/full/op/layer, LoRA, validation, activation offload, resume at another cp, export. The rest
is refused here in one line.
"""
from __future__ import annotations

from shardtune.errors import UserError


def _positive(value, what: str, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{what} {value!r} is not a positive integer ({key})")


def cp_local_heads(hf: dict, tp: int = 1) -> tuple[int, int]:
    """(query heads, KV heads) of one tp rank: what the all-to-all splits over cp."""
    heads = int(hf["num_attention_heads"])
    kv = int(hf.get("num_key_value_heads") or heads)
    return heads // tp, max(1, kv // tp)


def kv_repeat(kv_heads: int, q_heads: int, cp: int) -> int:
    """How often each (tp-local) KV head is repeated before the all-to-all so that cp divides the
    KV heads: the smallest r dividing q_heads / kv_heads with (kv_heads * r) % cp == 0 (1 when cp
    divides the KV heads already; q_heads / kv_heads at most, when every query head gets its own)."""
    group = q_heads // kv_heads
    for r in range(1, group + 1):
        if group % r == 0 and (kv_heads * r) % cp == 0:
            return r
    return group


def check_cp(cp: int, *, world_size: int | None = None, tp: int = 1,
             seq_len: int | None = None, sequence_parallel: bool = True, hf: dict | None = None,
             quantize_base: str = "none", compile: bool = False) -> None:
    """The one rule of context parallelism (parallel.cp / --cp), one UserError line each: cp is a
    positive integer; tp x cp divides the world size (the strategy, FSDP2 only: strategies.py);
    cp (x tp with sequence parallelism) divides train.seq_len; cp divides the query heads of one tp
    rank (the all-to-all hands each cp rank H / tp / cp heads; KV heads are repeated as needed,
    `kv_repeat`); and nothing cp has not been made to work with. Arguments left None (or at their
    defaults) are not checked: the planner passes what it knows, the trainer everything."""
    _positive(cp, "context-parallel degree", "parallel.cp / --cp")
    _positive(tp, "tensor-parallel degree", "parallel.tp / --tp")
    if cp == 1:
        return
    if world_size is not None and world_size % (tp * cp):
        what = f"tp x cp = {tp * cp}" if tp > 1 else f"cp {cp}"
        raise UserError(f"{what} does not divide the world size {world_size} (world = dp x cp x tp); start a "
                        f"multiple of {tp * cp} processes or lower parallel.cp / --cp")
    split = cp * tp if (tp > 1 and sequence_parallel) else cp
    if seq_len is not None and seq_len % split:
        what = f"cp x tp = {split} (cp {cp}, tp {tp} with sequence parallelism)" if split != cp else f"cp {cp}"
        raise UserError(f"context parallelism splits train.seq_len {seq_len} over {what}: make train.seq_len a "
                        f"multiple of {split} (--seq-len), or lower parallel.cp / --cp")
    if hf is not None:
        heads, _kv = cp_local_heads(hf, tp)
        if heads % cp:
            local = f"{heads} query heads per tp rank ({hf['num_attention_heads']} / tp {tp})" if tp > 1 else \
                f"{heads} attention heads"
            raise UserError(f"cp {cp} does not divide the model's {local}: the all-to-all hands each cp rank a "
                            "share of the heads; choose a cp that divides them (parallel.cp / --cp)")
    refused = (
        (quantize_base != "none", f"QLoRA's NF4 base (lora.quantize_base {quantize_base}: not tried on the "
                                  "dp x cp mesh): lora.quantize_base none, or parallel.cp 1"),
        # parallel/cp.py's compiled attention is an opaque op whose backward recomputes the forward: a
        # dropout mask drawn there would differ from the forward's
        (compile and float((hf or {}).get("attention_dropout") or 0) > 0,
         f"train.compile with the model's attention dropout {(hf or {}).get('attention_dropout')} (the compiled "
         "backward recomputes the attention, with another mask): train.compile=false, or parallel.cp 1"),
    )
    for bad, what in refused:
        if bad:
            raise UserError(f"parallel.cp {cp} does not compose with {what}")


def check_activation_offload(activation_offload: bool, *, compile: bool = False, objective: str = "sft",
                             offload: str = "none") -> None:
    """parallel.activation_offload's rule: it composes with every strategy, AC mode and cp; refused
    with what it was not made to work with (one line each)."""
    if not activation_offload:
        return
    refused = (
        (compile, "train.compile (saved-tensor hooks inside compiled regions were not tried): train.compile=false"),
        (objective != "sft", f"train.objective {objective} (the pair step does not offload): train.objective sft"),
        (offload == "all", "offload 'all' (the CPU holds the states already; not tried together): "
                           "parallel.offload none"),
    )
    for bad, what in refused:
        if bad:
            raise UserError(f"parallel.activation_offload does not compose with {what}, or "
                            "parallel.activation_offload=false")
