"""How many chunks the chunked cross-entropy uses (`train.loss_chunks`), shared by the planner
(plan/strategy_plan.py) and the trainer (train/core/chunked_loss.py, step.py, dpo.py). Imports no
torch. Why these numbers: docs/loss.md.
"""
from __future__ import annotations

CHUNK_ABOVE_VOCAB = 32_768  # vocabularies above this are chunked by default (Llama-2/Mistral: not)
DEFAULT_CHUNKS = 8  # torchtune's CEWithChunkedOutputLoss default (num_output_chunks = 8)


def default_loss_chunks(vocab_size: int) -> int:
    """`train.loss_chunks: None`: 8 chunks above a 32k vocabulary, else 1 (the full computation)."""
    return DEFAULT_CHUNKS if vocab_size > CHUNK_ABOVE_VOCAB else 1


def resolve_loss_chunks(loss_chunks: int | None, vocab_size: int, tp: int = 1) -> int:
    """The chunk count a run uses: the recipe's, or the default for this vocabulary; under tensor
    parallelism 1 (the loss is vocabulary-parallel, `loss_parallel`: V / tp logits a token already;
    tp refuses an explicit K > 1)."""
    if tp > 1:
        return 1
    return default_loss_chunks(vocab_size) if loss_chunks is None else int(loss_chunks)
