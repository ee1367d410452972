# The image `shardtune launch k8s --image IMAGE` runs (docs/multinode.md, "The image"): a CUDA
# base, the RDMA userspace NCCL needs for InfiniBand / RoCE, torch's CUDA build, this project and
# its extras. Build and push: make image IMAGE=ghcr.io/your-org/shardtune:1.0 && docker push ...
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# torch from its CUDA index (PyPI's default torch wheel targets another CUDA); extras as in pyproject.toml
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG EXTRAS=lora,data,8bit

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# libibverbs + providers + librdmacm: without them NCCL finds no IB/RoCE device in the container and
# falls back to TCP sockets without a word. Ubuntu's packages follow the base image's release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv libibverbs1 ibverbs-providers librdmacm1 \
    && rm -rf /var/lib/apt/lists/*

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# (DL3013: the pin is TORCH_SPEC's, which hadolint cannot see through the variable)
# hadolint ignore=DL3013
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"

WORKDIR /opt/shardtune
COPY pyproject.toml README.md ./
COPY shardtune ./shardtune
# (DL3013: this project from its own folder; its dependencies' ranges are pyproject.toml's)
# hadolint ignore=DL3013
RUN pip install ".[${EXTRAS}]" \
    && shardtune --help > /dev/null

# Runs as root: the pod's IPC_LOCK capability (k8s launch under ib/roce, for the verbs' pinned
# memory) reaches no non-root process, and checkpoints go to the claim with the claim's owner.
WORKDIR /workspace
CMD ["shardtune", "--help"]
