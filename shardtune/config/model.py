"""`model:` — which weights to train."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from shardtune.config.base import _Section


class ModelConfig(_Section):
    name: str = Field("tiny-llama", description="Catalogue name (e.g. llama-3-8b, tiny-llama) or a local HF "
                                                "model folder.")
    init: Literal["auto", "random", "pretrained"] = Field(
        "auto", description="auto: load safetensors weights when `name` is a folder that has them, else seeded "
                            "random init.")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the model folder. Off "
                                                       "unless you ask.")
