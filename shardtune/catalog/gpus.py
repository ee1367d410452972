"""Known GPUs: memory in bytes and dense BF16 peak FLOP/s, each citing its datasheet.

`memory_bytes` is the capacity the driver reports as the device total (nvidia-smi "Total" in MiB,
torch's `total_memory`), which is slightly below the marketing figure on HBM3 parts (H100 "80 GB":
81,559 MiB). `bf16_flops` is the dense (no 2:4 sparsity) BF16 tensor-core peak. Imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardtune.errors import UserError, suggest

MIB = 2**20


@dataclass(frozen=True)
class GPU:
    """One accelerator model."""

    name: str
    memory_bytes: int
    bf16_flops: float  # dense peak, FLOP/s
    hbm_bytes_per_s: float  # peak memory bandwidth
    source: str


GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("a100-40gb", 40_960 * MIB, 312e12, 1.555e12,
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    GPU("a100-80gb", 81_920 * MIB, 312e12, 2.039e12,
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    # H100 SXM5 80 GB (the PCIe card has 756 TFLOP/s).
    GPU("h100-80gb", 81_559 * MIB, 989.4e12, 3.35e12,
        "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
    GPU("h200-141gb", 143_771 * MIB, 989.4e12, 4.8e12,
        "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446"),
    GPU("l40s-48gb", 46_068 * MIB, 362.05e12, 0.864e12,
        "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    # GeForce RTX 4090: 165.2 TFLOP/s BF16 with FP32 accumulate (Ada whitepaper, appendix A).
    GPU("rtx4090-24gb", 24_564 * MIB, 165.2e12, 1.008e12,
        "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"),
    GPU("mi300x-192gb", 196_608 * MIB, 1307.4e12, 5.3e12,
        "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf"),
)}


def resolve_gpu(name: str) -> GPU:
    """The catalogue GPU called `name` (case-insensitive), or a UserError with a suggestion."""
    key = str(name).strip().lower()
    if key in GPUS:
        return GPUS[key]
    raise UserError(f"unknown GPU {name!r}{suggest(key, GPUS)}; choose one of {', '.join(GPUS)}")
