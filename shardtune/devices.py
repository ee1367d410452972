"""Which collective backend a run uses, decided one way for the launcher (before torchrun, torch-free
on a machine without a GPU) and for each rank (`setup_distributed`): `resolve_backend`."""
from __future__ import annotations

from pathlib import Path

from shardtune.errors import UserError

# Device nodes a CUDA (NVIDIA) or ROCm GPU shows on Linux. Without any, torch could see no GPU, and
# the launcher answers without importing torch (2 s of every launch on a CPU machine otherwise).
GPU_DEVICE_PATHS = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd", "/proc/driver/nvidia")


def has_gpu_nodes() -> bool:
    """Whether any GPU device node exists (torch-free): without one, torch sees no GPU."""
    return any(Path(p).exists() for p in GPU_DEVICE_PATHS)


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where no GPU device node exists."""
    if not has_gpu_nodes():
        return False
    import torch  # noqa: PLC0415 lazy: torch-free start-up of the launcher on a CPU machine

    return torch.cuda.is_available()


def resolve_backend(setting: str) -> str:
    """`train.backend` (auto, gloo, nccl) → the backend the ranks use: auto is nccl with CUDA, else
    gloo; nccl without CUDA is a UserError."""
    cuda = cuda_available() if setting in ("auto", "nccl") else False
    if setting == "nccl" and not cuda:
        raise UserError("train.backend=nccl needs CUDA, and this machine has none; use train.backend=auto or gloo")
    return "nccl" if setting == "nccl" or (setting == "auto" and cuda) else "gloo"
